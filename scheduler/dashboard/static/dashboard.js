// Pause the overview's htmx polling while the tab is hidden, refresh once on return.
// (A file, not an inline script or an hx-trigger filter: the page's CSP allows only
// scripts from /static and htmx runs with eval disabled.)
document.addEventListener("htmx:beforeRequest", function (event) {
  if (document.hidden && event.detail.elt.hasAttribute("data-poll")) {
    event.preventDefault();
  }
});
document.addEventListener("visibilitychange", function () {
  if (!document.hidden && window.htmx) {
    document.querySelectorAll("[data-poll]").forEach(function (el) {
      window.htmx.trigger(el, "visible-again");
    });
  }
});
// The shard picker switches as soon as a shard is chosen (its button is for no-script use).
document.addEventListener("change", function (event) {
  if (event.target.matches && event.target.matches("select[data-autosubmit]")) {
    event.target.form.submit();
  }
});
