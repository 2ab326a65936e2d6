"""The server's routes by family: each module's `add_routes(app, server)` registers its routes on the app
(create_app calls them in turn).

    completions  /v1/chat/completions, /v1/completions (OpenAI's; also without /v1)
    responses    /v1/responses, /v1/responses/{id} (OpenAI's Responses API, converted to chat)
    messages     /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API, converted to chat)
    info         /health, /v1/models, /v1/models/{model}, /metrics
    tokens       /tokenize, /detokenize (llama-server's)
    slots        /slots, /slots/{id}?action=erase|save|restore (llama-server's)
    llama        /props, /apply-template, /completion (llama-server's)
    workers      /get_load, /server_info, /model_info (and their /get_ forms), /version: what routers read
    live         /v1/moerun/state (the web page's live view: expert use, cache, slots, placement)
    webui        / and /webui/NAME: the web page (off with --no-webui)
"""
