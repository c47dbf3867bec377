"""Capture: the suite bundled, and read by engines (fast pass, rationales, golden replay)."""
