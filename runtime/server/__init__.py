"""The HTTP server: an aiohttp app over one Engine, speaking SGLang's native protocol and the OpenAI API.

The app runs in the main process (tokenizing, tracking requests, chat templates); the scheduler runs in its own
process as with any Engine, and detokenization happens on the engine's receiver thread, off the event loop.
"""
