"""The `pan2-render` commands."""
