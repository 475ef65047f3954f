"""Small models and tokenizers built locally (there is no model hub on these machines)."""
