"""A literate, notebook-driven toolkit for pretraining and fine-tuning GPT-style language models on rented GPU pods

Modules:

- `lmbook.api`: `lmbook serve`: the engine behind OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on Starlette and uvicorn, every request checked on its own, a key on the door, a graceful stop; and a RunPod serverless worker.
- `lmbook.serve`: The engine of `lmbook serve`: continuous batching over one KV cache, every request in its own row at its own position, joining and leaving at any step, sampled on the device with its own seed."""

__version__ = "0.1.0"
