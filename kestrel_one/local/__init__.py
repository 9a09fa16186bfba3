"""Single host: `serve`, its local workers, the embedded broker, runtime files."""
