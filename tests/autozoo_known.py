"""Model types of the full zoo that fail today, with the failure class and the error's first line.

Generated from a full run: ``benchmarks/tracing/full_zoo.py --from-json out/full_zoo.json --known``. The tests of
these model types are ``xfail(strict=True)``: a fix makes them pass, and the entry must then go.
"""

KNOWN: dict[str, tuple[str, str]] = {
    "albert": (
        "refused",
        "TracingError: target albert.encoder.albert_layer_groups.0 (AlbertLayerGroup) is called 2 times in one forward (a layer shared, or looped over as in recurrent-depth models): a sequential run calibra... (albert.encoder.albert_layer_groups.0)",
    ),
    "apertus1p5": (
        "no-tiny-build",
        "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: The audio token range ends at 266440, beyond the vocabulary (`text_config.vocab_size` ... (dataclasses.py:253)",
    ),
    "bailing_hybrid": (
        "no-eager",
        "RuntimeError: shape '[-1, 8, 0]' is invalid for input of size 48 (modeling_bailing_hybrid.py:808)",
    ),
    "blip": (
        "no-eager",
        "TypeError: BlipForConditionalGeneration.forward() missing 1 required positional argument: 'pixel_values' (generic.py:1036)",
    ),
    "blip-2": (
        "no-eager",
        "TypeError: Blip2ForConditionalGeneration.forward() missing 1 required positional argument: 'pixel_values' (generic.py:1036)",
    ),
    "blt": (
        "no-eager",
        "AttributeError: 'BltConfig' object has no attribute 'num_hidden_layers' (configuration_utils.py:312)",
    ),
    "chameleon": (
        "no-tiny-build",
        "AttributeError: 'NoneType' object has no attribute 'get' (modeling_chameleon.py:721)",
    ),
    "cohere_compass": ("no-tiny-build", "KeyError: 'full_attention' (modeling_cohere_compass.py:80)"),
    "cohere_compass_text": ("no-tiny-build", "KeyError: 'full_attention' (modeling_cohere_compass.py:80)"),
    "dbrx": (
        "no-tiny-build",
        "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta' (configuration_utils.py:312)",
    ),
    "deepseek_ocr2": (
        "no-tiny-build",
        "TypeError: 'NoneType' object is not subscriptable (modeling_deepseek_ocr2.py:1221)",
    ),
    "diffusion_gemma": (
        "no-tiny-build",
        "TypeError: empty(): argument 'size' (position 1) must be tuple of ints, but found element of type NoneType at pos 0 (linear.py:109)",
    ),
    "dory": (
        "refused",
        "TracingError: target model.layers.1 (DoryDecoderLayer) is called 2 times in one forward (a layer shared, or looped over as in recurrent-depth models): a sequential run calibrates each target once, ... (model.layers.1)",
    ),
    "dots1": (
        "no-tiny-build",
        "TypeError: empty() takes 1 positional argument but 3 were given (modeling_dots1.py:322)",
    ),
    "dots3_note": (
        "no-tiny-build",
        "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: vision adapter output width must match the text hidden size (dataclasses.py:253)",
    ),
    "emu3": (
        "no-tiny-build",
        "AttributeError: 'NoneType' object has no attribute 'get' (modeling_emu3.py:1061)",
    ),
    "ernie4_5_vl_moe": (
        "no-eager",
        "RuntimeError: stack expects each tensor to be equal size, but got [1, 12, 2] at entry 0 and [1, 12, 3] at entry 1 (modeling_ernie4_5_vl_moe.py:129)",
    ),
    "esm": (
        "no-tiny-build",
        "TypeError: empty(): argument 'size' (position 1) must be tuple of ints, but found element of type NoneType at pos 0 (sparse.py:166)",
    ),
    "fast_vlm": (
        "no-tiny-build",
        "ImportError: TimmWrapperModel requires the timm library but it was not found in your environment. You can install it with pip: `pip install timm`. Please note that you may need to restart your runt... (import_utils.py:2532)",
    ),
    "gemma3n": (
        "no-tiny-build",
        "ImportError: TimmWrapperModel requires the timm library but it was not found in your environment. You can install it with pip: `pip install timm`. Please note that you may need to restart your runt... (import_utils.py:2532)",
    ),
    "gemma4_assistant": (
        "no-tiny-build",
        "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: hidden_size_per_layer_input must be 0, got 256 (dataclasses.py:253)",
    ),
    "gemma4_unified_assistant": (
        "no-eager",
        "ValueError: inputs_embeds and shared_kv_states cannot be None. (modeling_gemma4_unified_assistant.py:173)",
    ),
    "granite4_vision": (
        "no-tiny-build",
        "TypeError: object of type 'NoneType' has no len() (modeling_granite4_vision.py:767)",
    ),
    "hrm_text": (
        "refused",
        "TracingError: target model.H_module.layers.1 (HrmTextDecoderLayer) is called 2 times in one forward (a layer shared, or looped over as in recurrent-depth models): a sequential run calibrates each t... (model.H_module.layers.1)",
    ),
    "idefics": (
        "no-eager",
        "ValueError: Exactly 1 of pixel_values, image_encoder_embeddings or perceiver_embeddings has to be not-None. (modeling_idefics.py:956)",
    ),
    "inkling_mm_model": (
        "no-tiny-build",
        "ModuleNotFoundError: No module named 'scipy' (modeling_inkling.py:960)",
    ),
    "instructblip": (
        "no-eager",
        "TypeError: InstructBlipForConditionalGeneration.forward() missing 2 required positional arguments: 'pixel_values' and 'qformer_input_ids' (generic.py:1036)",
    ),
    "instructblipvideo": (
        "no-eager",
        "TypeError: InstructBlipVideoForConditionalGeneration.forward() missing 2 required positional arguments: 'pixel_values' and 'qformer_input_ids' (generic.py:1036)",
    ),
    "kosmos-2": (
        "no-eager",
        "ValueError: You have to specify either `pixel_values` or `image_embeds`. (modeling_kosmos2.py:1612)",
    ),
    "lfm2_moe": (
        "no-tiny-build",
        "TypeError: 'NoneType' object is not subscriptable (modeling_lfm2_moe.py:474)",
    ),
    "llama4": (
        "no-eager",
        "AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs' (modeling_llama4.py:1318)",
    ),
    "mllama": (
        "refused",
        "TracingError: 1 target(s) (model.language_model.layers.1) are not called for the trace sample's inputs: the branches at /work/main/.venv/lib/python3.11/site-packages/transformers/models/mllama/mode... (modeling_mllama.py:1136)",
    ),
    "mobilebert": (
        "no-eager",
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (12x128 and 64x64) (linear.py:134)",
    ),
    "molmo2": (
        "no-tiny-build",
        "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `adapter_config.vision_feature_layer` [24, 18] must index the 2 layers of `vision_conf... (dataclasses.py:253)",
    ),
    "musicgen": (
        "no-tiny-build",
        "AttributeError: 'MusicgenConfig' object has no attribute 'dropout' (configuration_utils.py:312)",
    ),
    "musicgen_melody": (
        "no-tiny-build",
        "AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout' (configuration_utils.py:312)",
    ),
    "nemo_speechlm": (
        "no-eager",
        "RuntimeError: repeat_interleave: Invalid output_size, expected 0 but got 4 (modeling_nemotron_h.py:299)",
    ),
    "nemotron_h": (
        "no-eager",
        "RuntimeError: repeat_interleave: Invalid output_size, expected 0 but got 4 (modeling_nemotron_h.py:299)",
    ),
    "nemotron_h_omni": (
        "no-tiny-build",
        "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture': ValueError: `vision_config.video_temporal_patch_size` (None) and `video_temporal_patch_size` (2) m... (dataclasses.py:253)",
    ),
    "paligemma": (
        "no-eager",
        "RuntimeError: The size of tensor a (4) must match the size of tensor b (16) at non-singleton dimension 1 (sdpa_attention.py:182)",
    ),
    "perception_lm": (
        "no-tiny-build",
        "ImportError: TimmWrapperModel requires the timm library but it was not found in your environment. You can install it with pip: `pip install timm`. Please note that you may need to restart your runt... (import_utils.py:2532)",
    ),
    "pi0": (
        "no-eager",
        "TypeError: PI0ForConditionalGeneration.forward() missing 1 required positional argument: 'state' (deprecation.py:173)",
    ),
    "pix2struct": (
        "no-eager",
        "ValueError: You have to specify flattened_patches (modeling_pix2struct.py:462)",
    ),
    "pp_formulanet": (
        "no-eager",
        "ValueError: You must specify exactly one of encoder_outputs or pixel_values (modeling_pp_formulanet.py:995)",
    ),
    "qwen2_5_omni_thinker": (
        "no-eager",
        "AttributeError: 'Qwen2_5OmniThinkerConfig' object has no attribute 'vision_start_token_id' (configuration_utils.py:312)",
    ),
    "qwen3_omni_moe_thinker": (
        "no-eager",
        "AttributeError: 'Qwen3OmniMoeThinkerConfig' object has no attribute 'vision_start_token_id' (configuration_utils.py:312)",
    ),
    "qwen4_exp": (
        "no-tiny-build",
        "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType' (modeling_qwen4_exp.py:699)",
    ),
    "qwen4_exp_text": (
        "no-tiny-build",
        "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType' (modeling_qwen4_exp.py:699)",
    ),
    "udop": (
        "no-eager",
        "ValueError: Bbox is required for horizontal relative position bias (modeling_udop.py:991)",
    ),
    "vision-encoder-decoder": (
        "no-eager",
        "ValueError: You have to specify pixel_values (modeling_vision_encoder_decoder.py:387)",
    ),
    "voxtral_realtime": (
        "no-eager",
        "ValueError: You must specify exactly one of input_features or encoder_inputs_embeds (modeling_voxtral_realtime.py:956)",
    ),
    "xmod": (
        "no-eager",
        "ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_default_language()` (modeling_xmod.py:734)",
    ),
    "zamba": (
        "no-tiny-build",
        "ValueError: There is an issue with your definition of `tie_weights_keys` for ^layers.2.shared_transf:^layers.(?!2\\.)\\d+.shared_transf. We found ['layers.2.shared_transf.feed_forward.down_proj.weigh... (modeling_utils.py:2521)",
    ),
    "zamba2": (
        "no-eager",
        "RuntimeError: The size of tensor a (64) must match the size of tensor b (128) at non-singleton dimension 2 (modeling_zamba2.py:86)",
    ),
}
