"""Code the tests share: references, harness pieces and family checks (not collected)."""
