"""``baton serve`` under load: the serve benchmark and the reliability soak, over a real
server subprocess."""
