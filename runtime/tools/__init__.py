"""Tool calls at the OpenAI edge: tool definitions and choices as typed data (protocol.py), the call formats model
families emit and how each is generated under constraint (formats.py), the pythonic parser (pythonic.py)."""
