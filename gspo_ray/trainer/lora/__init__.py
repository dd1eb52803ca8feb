"""LoRA on the Megatron trainer: adapters on a frozen base, any TP / EP (docs/lora.md).

    adapters.py   LoRAPair / ParallelLoRA on the parallel linears and MoE experts, apply_lora, the reference
                  policy's forward (reference_adapters), full (TP 1) adapters <-> this rank's shards
    peft_io.py    PEFT names, gathered / loaded full adapters, PEFT directories (adapter_config.json), merged weights
    worker.py     what a TrainerWorker does with trainer.lora: attach, push, checkpoint, the KL's reference
    export.py     a LoRA checkpoint -> PEFT adapter directory or merged HF state, offline (gspo-ray export)
"""
