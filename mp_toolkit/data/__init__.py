"""Training data: packed causal-LM corpora (`lm`), BERT MLM + NSP corpora (`mlm`) and synthetic
text (`synthetic`); each yields one data-parallel replica's micro-batches. Both read their texts
with `corpus` and tokenize them with `tokens` (byte-level BPE, cached). Imports only the core."""
