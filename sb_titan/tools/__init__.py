"""Command-line tools (sb-train, sb-profile, sb-simulate, sb-plan, sb-prep, sb-export):
the top layer; nothing in the package imports them."""
