// An action in flight (data-action-wait: its API address) is followed until it ends, then its page is shown
// (data-action-done, or the page itself): an inspection's answer appears when Spark has read it, a preview's verdict
// when Spark has planned the new version, without a click on "refresh".
document.querySelectorAll("[data-action-wait]").forEach((row) => {
  const follow = async () => {
    try {
      const response = await fetch(row.dataset.actionWait, { headers: { Accept: "application/json" } });
      if (response.ok) {
        const action = await response.json();
        // data-action-shows: also shown again once the action's params hold that key (a preview's verdict, which
        // comes before the action ends)
        const shows = row.dataset.actionShows;
        if (!["pending", "running"].includes(action.status) || (shows && action.params && action.params[shows])) {
          window.location.assign(row.dataset.actionDone || window.location.href);
          return;
        }
        const progress = row.querySelector(".progress");
        if (progress && action.progress) progress.textContent = action.progress;
      }
    } catch (error) {
      // the console restarting: keep asking
    }
    window.setTimeout(follow, 400);
  };
  window.setTimeout(follow, 400);
});
