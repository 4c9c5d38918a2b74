"""The OpenAI-compatible HTTP API over the stores (`api`): each store answered by its own model
(`emllm.ModelPool`), stores kept open between requests, a request's store named as its model.
May import: the public surface (`emllm`) only, as the CLI does."""
