"""systemd units for ddserve: rendered from the config, installed and checked with systemd's tools."""
