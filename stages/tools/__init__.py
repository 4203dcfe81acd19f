"""Offline tools over finished LoRA files, run after training (`lorapipe lora ...`): merge, resize,
extract and post-hoc EMA. No GPU and no base weights (extract reads two models' weights one module at
a time). Not a stage: nothing here is in the stage registry, and no stage imports it.

    lorapipe lora merge a.safetensors b.safetensors --weights 0.7,0.3 --rank 32 -o ab.safetensors
"""
