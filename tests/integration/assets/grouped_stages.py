"""A TransformerLM whose biases and norm weights get no weight decay and a tenth of the lr (a
common recipe), through Stage.optimizer_groups."""

from stages.chain import TransformerLM


class GroupedLM(TransformerLM):
    def optimizer_groups(self, spec):
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        return [(dict(spec), decay), ({**spec, "weight_decay": 0.0, "lr": spec["lr"] * 0.1}, no_decay)]
