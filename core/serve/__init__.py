"""The OpenAI-compatible HTTP API over the stores (`api`): the model loaded once, stores kept open
between requests, a request's store named as its model. May import: the public surface (`emllm`)
only, as the CLI does."""
