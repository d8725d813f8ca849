"""A run's configuration: one YAML file, validated strictly before any process starts."""
