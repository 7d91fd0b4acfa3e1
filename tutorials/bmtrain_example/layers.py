"""The layers of the example GPT, written the way BMTrain's own example writes them.

Each layer is a `bmt.DistributedModule`; the weights it owns are
`bmt.DistributedParameter`s with an initialiser that `bmt.init_parameters` runs.
The linear layers of attention and of the feed-forward network are tensor-parallel
(`bmt.nn.ColumnParallelLinear` / `bmt.nn.RowParallelLinear`): between layers each
tensor-parallel rank holds its own slice of the batch; a column-parallel layer
gathers the whole batch and computes its share of the output features, a
row-parallel layer sums the shares and hands every rank its slice of the batch back.
"""
import math

import torch
import torch.nn.functional as F

import nbtrain as bmt  # was: import bmtrain as bmt


class Embedding(bmt.DistributedModule):
    """A lookup table (the position embedding); `projection=True` multiplies by its
    transpose instead."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None,
                 init_std: float = 1.0):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = bmt.DistributedParameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype),
            init_method=bmt.ParameterInitializer(torch.nn.init.normal_, mean=0.0, std=init_std),
        )

    def forward(self, input: torch.Tensor, projection: bool = False) -> torch.Tensor:
        if projection:
            return F.linear(input, self.weight)
        return F.embedding(input, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Layernorm(bmt.DistributedModule):
    """Layer normalisation over the last dimension, with a learnt scale and shift."""

    def __init__(self, dim_norm: int, eps: float = 1e-5, dtype=None):
        super().__init__()
        self.normalized_shape = (dim_norm,)
        self.eps = eps
        self.weight = bmt.DistributedParameter(
            torch.empty(dim_norm, dtype=dtype),
            init_method=bmt.ParameterInitializer(torch.nn.init.ones_))
        self.bias = bmt.DistributedParameter(
            torch.empty(dim_norm, dtype=dtype),
            init_method=bmt.ParameterInitializer(torch.nn.init.zeros_))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Attention(bmt.DistributedModule):
    """Multi-head self-attention; each tensor-parallel rank computes num_heads / tp_size
    of the heads over the whole batch."""

    def __init__(self, dim_model: int, dim_head: int, num_heads: int, bias: bool = True,
                 dtype=None):
        super().__init__()
        self.project_q = bmt.nn.ColumnParallelLinear(dim_model, dim_head * num_heads,
                                                     bias=bias, dtype=dtype)
        self.project_k = bmt.nn.ColumnParallelLinear(dim_model, dim_head * num_heads,
                                                     bias=bias, dtype=dtype)
        self.project_v = bmt.nn.ColumnParallelLinear(dim_model, dim_head * num_heads,
                                                     bias=bias, dtype=dtype)
        self.project_out = bmt.nn.RowParallelLinear(dim_head * num_heads, dim_model,
                                                    bias=bias, dtype=dtype)
        self.softmax = torch.nn.Softmax(dim=-1)
        self.dim_head = dim_head
        self.num_heads = num_heads
        self.dim_model = dim_model

    def forward(self,
                hidden_q: torch.Tensor,    # (batch / tp, seq_q, dim_model): this rank's rows
                hidden_kv: torch.Tensor,   # (batch / tp, seq_kv, dim_model)
                mask: torch.BoolTensor,    # (batch, seq_q, seq_kv): the whole batch
                position_bias: torch.Tensor | None = None,  # (batch, heads, seq_q, seq_kv)
                ) -> torch.Tensor:
        # The column-parallel projections gather the whole batch: from here on the
        # tensors hold every sequence, and this rank's heads only.
        h_q = self.project_q(hidden_q)
        h_k = self.project_k(hidden_kv)
        h_v = self.project_v(hidden_kv)

        batch_size, seq_q = h_q.size(0), h_q.size(1)
        seq_kv = h_k.size(1)

        # (batch, seq, local heads, dim_head) -> (batch * local heads, seq, dim_head)
        h_q = h_q.view(batch_size, seq_q, -1, self.dim_head).permute(0, 2, 1, 3)
        h_k = h_k.view(batch_size, seq_kv, -1, self.dim_head).permute(0, 2, 1, 3)
        h_v = h_v.view(batch_size, seq_kv, -1, self.dim_head).permute(0, 2, 1, 3)
        h_q = h_q.reshape(-1, seq_q, self.dim_head)
        h_k = h_k.reshape(-1, seq_kv, self.dim_head)
        h_v = h_v.reshape(-1, seq_kv, self.dim_head)

        score = torch.bmm(h_q, h_k.transpose(1, 2)) / math.sqrt(self.dim_head)
        score = score.view(batch_size, -1, seq_q, seq_kv)
        if position_bias is not None:
            score = score + position_bias.view(batch_size, -1, seq_q, seq_kv)

        mask = mask.view(batch_size, 1, seq_q, seq_kv)
        score = torch.where(mask, score,
                            torch.scalar_tensor(float("-inf"), dtype=score.dtype,
                                                device=score.device))
        # A query that may look at nothing (a padded position) gets zeros, not NaN.
        score = torch.where(mask, self.softmax(score),
                            torch.scalar_tensor(0, dtype=score.dtype, device=score.device))
        score = score.view(-1, seq_q, seq_kv)

        h_out = torch.bmm(score, h_v)                              # (batch * heads, seq_q, dim_head)
        h_out = h_out.view(batch_size, -1, seq_q, self.dim_head)
        h_out = h_out.permute(0, 2, 1, 3).reshape(batch_size, seq_q, -1)

        # The row-parallel projection sums the heads' shares and returns this
        # rank's rows of the batch.
        return self.project_out(h_out)


class Feedforward(bmt.DistributedModule):
    """Two linear layers with a ReLU between them; the hidden features are split over
    the tensor-parallel ranks."""

    def __init__(self, dim_model: int, dim_ff: int, bias: bool = True, dtype=None):
        super().__init__()
        self.w_in = bmt.nn.ColumnParallelLinear(dim_model, dim_ff, bias=bias, dtype=dtype)
        self.w_out = bmt.nn.RowParallelLinear(dim_ff, dim_model, bias=bias, dtype=dtype)
        self.relu = torch.nn.ReLU()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.w_out(self.relu(self.w_in(input)))


class TransformerEncoder(bmt.DistributedModule):
    """One pre-norm transformer layer: attention, then the feed-forward network, each
    added to the residual stream."""

    def __init__(self, dim_model: int, dim_head: int, num_heads: int, dim_ff: int,
                 bias: bool = True, dtype=None):
        super().__init__()
        self.ln_attn = Layernorm(dim_model, dtype=dtype)
        self.attn = Attention(dim_model, dim_head, num_heads, bias=bias, dtype=dtype)
        self.ln_ff = Layernorm(dim_model, dtype=dtype)
        self.ff = Feedforward(dim_model, dim_ff, bias=bias, dtype=dtype)

    def forward(self,
                hidden: torch.Tensor,      # (batch / tp, seq_len, dim_model)
                mask: torch.BoolTensor,    # (batch, seq_len, seq_len)
                position_bias: torch.Tensor | None = None,
                ) -> torch.Tensor:
        bmt.inspect.record_tensor(hidden, "hidden")
        x = self.ln_attn(hidden)
        x = self.attn(x, x, mask, position_bias)
        hidden = hidden + x

        x = self.ln_ff(hidden)
        x = self.ff(x)
        hidden = hidden + x.view_as(hidden)
        return hidden
