// The Deploys tab's blue/green panel: refreshed every 2 s while the page is open (green's batch beside the job's,
// and its per-batch diff), except while a control in it has the focus.
(function () {
  const panel = document.getElementById("blue-green");
  if (!panel) return;
  setInterval(function () {
    if (panel.contains(document.activeElement)) return;
    fetch(panel.dataset.refresh, {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null) panel.innerHTML = html; });
  }, 2000);
})();
