from tests.console.browser import (  # noqa: F401  (fixtures)
    browser_page,
    chromium,
    monkeypatch_module,
)
