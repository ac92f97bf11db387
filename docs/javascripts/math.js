// Typeset the math that pymdownx.arithmatex (generic mode) leaves in the page:
// <span class="arithmatex">\( ... \)</span> and <div class="arithmatex">\[ ... \]</div>.
// KaTeX and its auto-render extension are served from assets/vendor/ (see
// scripts/fetch_site_assets.sh). `document$` is mkdocs-material's page observable, so
// this also runs after instant navigation swaps the page.
document$.subscribe(function () {
  document.querySelectorAll(".arithmatex").forEach(function (el) {
    renderMathInElement(el, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true }
      ],
      throwOnError: false
    });
  });
});
