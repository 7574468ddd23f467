// A button with data-confirm asks before its form is sent. No inline handlers: the pages run only their own files.
document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-confirm]");
  if (button && !window.confirm(button.dataset.confirm)) {
    event.preventDefault();
  }
});
