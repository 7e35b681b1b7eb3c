"""Tokenization on the CPU: `tokenizer.Tokenizer` (Hugging Face `tokenizers`, with a chat
template) and `tokenizer_json` (a tokenizer read straight from a `tokenizer.json` folder, without
`transformers`). Imports no torch."""
