"""Read-only views of an output folder: status and show text, the report and its posters, compare,
estimates."""
