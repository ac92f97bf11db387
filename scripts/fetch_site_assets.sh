#!/usr/bin/env bash
# Fetch the JavaScript and CSS the lesson site serves itself, so it works offline.
#
# mkdocs-material loads Mermaid from a CDN unless a `mermaid` global already exists
# when a diagram is mounted; math needs KaTeX; search from a site opened from disk
# needs the iframe-worker shim. All come from the npm registry as
# pinned tarballs (`npm pack`), checked against the SHA-256 below, and are unpacked
# into docs/assets/vendor/ (gitignored). mkdocs.yml lists them in extra_javascript
# and extra_css; docs/hooks.py stops the build if they are missing.
#
# Idempotent: when the stamp file records these exact versions and every file is
# there, it does nothing (and needs no network). FORCE=1 fetches again.
#
#   bash scripts/fetch_site_assets.sh            # before `mkdocs build` / `mkdocs serve`
#   FORCE=1 bash scripts/fetch_site_assets.sh    # re-download
#
# To bump a version: change it below, run with the new version once, and paste the
# SHA-256 the script prints into the matching *_SHA256 line.
set -euo pipefail

MERMAID_VERSION="11.17.2"   # material's own fallback is mermaid@11; stay on that major
MERMAID_SHA256="6ad2f42c3fc26bbf9e45cbb6d11898972573ea52b33a5f4ff51952899f950ffd"
KATEX_VERSION="0.19.1"
KATEX_SHA256="24da5a599eb2fcede2e270b99a6ff48bca816beecc95feeb84e8cccbd1bb34fd"
# material's offline plugin (search from a site opened from disk) needs this Web Worker
# shim; mkdocs.yml lists the local copy under extra.polyfills so no CDN copy is added.
IFRAME_WORKER_VERSION="1.0.4"
IFRAME_WORKER_SHA256="e8c5d12d87829c503afba01d67772ea9f4aba5b7ae57a0c98e1917711030efbb"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vendor="$repo_root/docs/assets/vendor"
stamp="$vendor/VERSIONS"
want_stamp="mermaid@$MERMAID_VERSION katex@$KATEX_VERSION iframe-worker@$IFRAME_WORKER_VERSION"

# The files the site references (keep in step with mkdocs.yml and docs/hooks.py).
required=(
  mermaid/mermaid.min.js
  katex/katex.min.js
  katex/katex.min.css
  katex/contrib/auto-render.min.js
  katex/fonts/KaTeX_Main-Regular.woff2
  iframe-worker/shim.js
)

up_to_date() {
  [[ -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]] || return 1
  local f
  for f in "${required[@]}"; do
    [[ -s "$vendor/$f" ]] || return 1
  done
}

if [[ "${FORCE:-0}" != "1" ]] && up_to_date; then
  echo "site assets up to date ($want_stamp) in ${vendor#"$repo_root"/}"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  echo "error: npm is needed once to fetch the site's offline assets ($want_stamp)." >&2
  echo "       Install Node.js/npm (e.g. apt-get install npm), then run this script again." >&2
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# fetch NAME VERSION SHA256 -> path of the verified tarball
fetch() {
  local name="$1" version="$2" sha="$3" tarball got
  echo "fetching $name@$version" >&2
  (cd "$work" && npm pack --silent "$name@$version" >/dev/null)
  tarball="$work/$name-$version.tgz"
  [[ -f "$tarball" ]] || { echo "error: npm pack did not produce $tarball" >&2; exit 1; }
  got="$(sha256sum "$tarball" | cut -d' ' -f1)"
  if [[ "$got" != "$sha" ]]; then
    echo "error: $name-$version.tgz has SHA-256 $got, expected $sha" >&2
    exit 1
  fi
  echo "$tarball"
}

mermaid_tgz="$(fetch mermaid "$MERMAID_VERSION" "$MERMAID_SHA256")"
katex_tgz="$(fetch katex "$KATEX_VERSION" "$KATEX_SHA256")"
iframe_worker_tgz="$(fetch iframe-worker "$IFRAME_WORKER_VERSION" "$IFRAME_WORKER_SHA256")"

# Unpack into a staging folder, then swap it in, so an interrupted run never leaves
# a half-written vendor folder that looks complete.
stage="$work/vendor"
mkdir -p "$stage/mermaid" "$stage/katex" "$stage/iframe-worker" "$work/m" "$work/k" "$work/i"

tar -xzf "$mermaid_tgz" -C "$work/m" package/dist/mermaid.min.js package/LICENSE
cp "$work/m/package/dist/mermaid.min.js" "$stage/mermaid/"
cp "$work/m/package/LICENSE" "$stage/mermaid/LICENSE"

tar -xzf "$katex_tgz" -C "$work/k" package/dist package/LICENSE
mkdir -p "$stage/katex/contrib"
cp "$work/k/package/dist/katex.min.js" "$work/k/package/dist/katex.min.css" "$stage/katex/"
cp "$work/k/package/dist/contrib/auto-render.min.js" "$stage/katex/contrib/"
cp -r "$work/k/package/dist/fonts" "$stage/katex/fonts"   # katex.min.css loads fonts/ relative to itself
cp "$work/k/package/LICENSE" "$stage/katex/LICENSE"

tar -xzf "$iframe_worker_tgz" -C "$work/i" package/shim/index.js package/LICENSE
cp "$work/i/package/shim/index.js" "$stage/iframe-worker/shim.js"
cp "$work/i/package/LICENSE" "$stage/iframe-worker/LICENSE"

echo "$want_stamp" > "$stage/VERSIONS"

for f in "${required[@]}"; do
  [[ -s "$stage/$f" ]] || { echo "error: $f missing from the unpacked packages" >&2; exit 1; }
done

mkdir -p "$(dirname "$vendor")"
rm -rf "$vendor.old"
[[ -e "$vendor" ]] && mv "$vendor" "$vendor.old"
mv "$stage" "$vendor"
rm -rf "$vendor.old"
echo "site assets ready ($want_stamp) in ${vendor#"$repo_root"/}"
