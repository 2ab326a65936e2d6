"""The OpenAI-compatible HTTP server (moerun serve)."""
