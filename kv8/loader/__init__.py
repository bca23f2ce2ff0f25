"""Where a model comes from and how it is read: aliases and paths (:mod:`~kv8.loader.sources`), the weights of a
Hugging Face directory or a GGUF file built into a model class (:mod:`~kv8.loader.model`,
:mod:`~kv8.loader.gguf`), and the tokenizer (:mod:`~kv8.loader.tokenizer`)."""
