"""The APIs beside chat completions, converted to it and back: OpenAI's Responses (responses.py) and Anthropic's
Messages (messages.py). Each turns its request into a ChatRequest, submits it with `start_chat` (one generation
path: the same template, tool-call and reasoning parsers, grammar and scheduler), and turns the chat answer, whole
or streamed chunk by chunk, into its own objects and events."""
