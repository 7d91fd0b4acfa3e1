"""The example GPT: embeddings, a list of transformer blocks, a final layer norm, and
logits through the word embedding (the output projection shares its weight)."""
import torch
from layers import Embedding, Layernorm, TransformerEncoder

import nbtrain as bmt  # was: import bmtrain as bmt


class GPT(bmt.DistributedModule):
    def __init__(self, num_layers: int, vocab_size: int, dim_model: int, dim_head: int,
                 num_heads: int, dim_ff: int, max_distance: int, bias: bool = True,
                 dtype=None) -> None:
        super().__init__()
        self.max_distance = max_distance

        # The vocabulary is split over the tensor-parallel ranks.
        self.word_emb = bmt.nn.VPEmbedding(vocab_size, dim_model, dtype=dtype)
        self.pos_emb = Embedding(max_distance, dim_model, dtype=dtype)

        # Each layer is a Block: its parameters are sharded over the ranks and
        # gathered for its forward and backward, one layer at a time.
        self.transformers = bmt.TransformerBlockList([
            bmt.Block(TransformerEncoder(dim_model, dim_head, num_heads, dim_ff, bias, dtype))
            for _ in range(num_layers)
        ])
        self.layernorm = Layernorm(dim_model, dtype=dtype)

    def forward(self,
                input: torch.LongTensor,   # (batch, seq_len)
                pos: torch.LongTensor,     # (batch, seq_len)
                mask: torch.BoolTensor,    # (batch, seq_len): False on padding
                ) -> torch.Tensor:
        # Who may attend to whom: both positions real, and the key not after the query.
        mask_2d = mask[:, None, :] & mask[:, :, None]  # (batch, seq_len, seq_len)
        mask_2d = mask_2d & (pos[:, None, :] <= pos[:, :, None])

        # Between layers each tensor-parallel rank holds its own rows of the batch.
        tp_size, tp_rank = bmt.config["tp_size"], bmt.config["tp_rank"]
        input = input.chunk(tp_size, dim=0)[tp_rank]
        pos = pos.chunk(tp_size, dim=0)[tp_rank]

        out = self.pos_emb(pos) + self.word_emb(input)
        out = self.transformers(out, mask_2d, None)
        out = self.layernorm(out)

        # (batch, seq_len, vocab_size / tp): every row, this rank's share of the vocabulary.
        logits = self.word_emb(out, projection=True)
        bmt.inspect.record_tensor(logits, "logits")
        return logits
