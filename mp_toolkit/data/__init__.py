"""Training data: packed causal-LM corpora (`lm`), BERT MLM + NSP corpora (`mlm`) and synthetic
text (`synthetic`); each yields one data-parallel replica's micro-batches. Imports only the core."""
