// An action in flight (data-action-wait: its API address) is followed until it ends, then its page is shown: an
// inspection's answer appears when Spark has read it, without a click on "refresh".
document.querySelectorAll("[data-action-wait]").forEach((row) => {
  const follow = async () => {
    try {
      const response = await fetch(row.dataset.actionWait, { headers: { Accept: "application/json" } });
      if (response.ok) {
        const action = await response.json();
        if (!["pending", "running"].includes(action.status)) {
          window.location.assign(row.dataset.actionDone);
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
