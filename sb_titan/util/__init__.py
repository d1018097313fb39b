"""Small helpers with no project imports, usable from every layer."""
