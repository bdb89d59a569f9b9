"""An OpenAI-compatible API in front of the `llm` ensemble (layer: above specserve/triton, below
specserve/cli).

    protocol.py  OpenAI request bodies → one typed GenerateCall; the OpenAI error shape
    chat.py      the checkpoint's own chat template, rendered by transformers' apply_chat_template
    backend.py   the `llm` ensemble over tritonclient's asyncio gRPC streaming (one stream a request)
    app.py       the FastAPI routes: /v1/models, /v1/completions, /v1/chat/completions (SSE or not)
    server.py    uvicorn on a bound socket, in the foreground or beside `specserve serve`
"""
