"""Tool use in rollouts: tools and their calls (``calls``), multi-turn rollouts (``multi_turn``),
environments (``environments``), and what ``model.tools``/``model.environment`` switch on (``tool_use``)."""
