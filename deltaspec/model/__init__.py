"""The hybrid model: config parsing, weight loading, tokenizer, layers, and the MTP head."""
