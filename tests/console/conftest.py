from tests.console.browser import browser_page, chromium  # noqa: F401  (fixtures)
