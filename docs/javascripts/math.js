// Typeset the math that pymdownx.arithmatex (generic mode) leaves in the page:
// <span class="arithmatex">\( ... \)</span> and <div class="arithmatex">\[ ... \]</div>,
// and the math of headings that the table of contents and the navigation repeat as
// plain text (e.g. "where \(\sqrt{n}\) comes from"). KaTeX and its auto-render
// extension are served from assets/vendor/ (see scripts/fetch_site_assets.sh).
// `document$` is mkdocs-material's page observable, so this also runs after instant
// navigation swaps the page. tests/site/test_site_browser.py checks no raw math is left.
document$.subscribe(function () {
  var options = {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true }
    ],
    throwOnError: false
  };
  document.querySelectorAll(".arithmatex").forEach(function (el) {
    renderMathInElement(el, options);
  });
  document.querySelectorAll(".md-nav__link").forEach(function (el) {
    if (el.textContent.indexOf("\\(") >= 0) renderMathInElement(el, options);
  });
});
