"""The OpenAI-compatible HTTP server on generate.py's model and caches:

serve.py       the server (`python -m serving.serve`, from the repository root)
batching.py    its engine: continuous batching, and the conversations it keeps
openai_api.py  the requests and errors of OpenAI's API, as serve.py takes them
"""
