"""`aftgen serve`: an OpenAI-compatible HTTP server that steps many sessions' fixed-size states as one batch."""
