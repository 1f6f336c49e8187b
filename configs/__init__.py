"""The configuration files that ship with the package (package data): hardware profiles
(`hardware/`), model configs (`models/`) and agent-session traces (`traces/`)."""
