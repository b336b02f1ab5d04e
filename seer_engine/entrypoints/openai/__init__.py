"""The OpenAI-compatible server: completions, chat, Files and Batch APIs, RL trainer endpoints."""
