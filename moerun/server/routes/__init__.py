"""The server's routes by family: each module's `add_routes(app, server)` registers its routes on the app
(create_app calls them in turn).

    completions  /v1/chat/completions, /v1/completions (OpenAI's; also without /v1)
    info         /health, /v1/models, /v1/models/{model}, /metrics
    tokens       /tokenize, /detokenize (llama-server's)
    slots        /slots, /slots/{id}?action=erase|save|restore (llama-server's)
"""
