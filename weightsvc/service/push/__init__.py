"""A push from header to answer: messages, shards, staging and export."""
