"""The one loss path: examples encoded into microbatches, the loss table, the loss hook, and
token logprobs computed over chunks of the head (shared with sampling)."""
