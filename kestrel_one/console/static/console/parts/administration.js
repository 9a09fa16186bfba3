// A page that shows a secret once is the answer to a POST. Replacing its history entry
// with the same address makes a reload (or coming back to it) a plain GET, which shows the
// page without the secret, instead of posting the form again and making another one.
if (document.querySelector("[data-shown-once]") && window.history.replaceState) {
  window.history.replaceState(null, "", window.location.href);
}
