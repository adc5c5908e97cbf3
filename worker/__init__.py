"""Worker side: transport, process group, launcher and user API."""
