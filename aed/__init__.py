"""aed: attention encoder-decoder speech models (Canary-style ASR and speech translation) in PyTorch.

    import aed
    model = aed.load_model("runs/tiny")                    # a run directory (its newest checkpoint) or a checkpoint
    results, timings = aed.transcribe(model, ["a.wav", "clips/"], source_lang="en")
    results, _ = aed.transcribe(model, ["talk.wav"], aed.DecodingOptions(beam_size=4), target_lang="de")
    print(results[0].pred_text, timings.rtfx)
    stream = aed.Streamer(model, aed.StreamConfig(chunk=1.0)).open(source_lang="en")
    stream.feed(samples); stream.finish(); print(stream.text)   # mono float samples at 16 kHz, any pieces

The package, one module per concept, in layers: inference at the base, training on top of it, the
commands on top. Each module imports only modules listed above it here (tests/test_layers.py checks
it), so `import aed` for decoding loads no training code.

config              typed dataclass configs: defaults, then YAML files, then key=value overrides
data
  data_audio        audio files -> log-mel features (NeMo's), SpecAugment
  data_speech       where the speech is (energy over the room's floor, or Silero VAD); silence at utterance edges
  data_tokenizer    special tokens + SentencePiece models in one id space, Canary prompts
  data_manifest     JSONL manifest lines -> checked Utterances; everything skipped counted (Faults)
  data_augment      degrading training audio on the fly: rooms, noise, gain, clipping, low-pass, codecs
  data_batch        an example -> its item (audio checked, features, ids) -> a padded Batch
  data_shards       aed's own tar shards; what all streamed readers share (shard order, resume, tar members)
  data_formats      other toolkits' datasets read in place: NeMo tarred, Lhotse Shar, Hugging Face parquet
  data_sources      a train.manifests entry, typed and checked (ManifestEntry) -> its reader
  data_mixing       temperature shares of sources and languages, non-speech examples, streams mixed by weight
model
  model_encoder     FastConformer encoder (NeMo's layout: Canary weights convert 1:1)
  model_decoder     Transformer decoder with its KV cache
  model             the AED: encoder + decoder + optional CTC head, its AEDConfig and losses
  model_transducer  transducer (RNN-T) head and loss
  model_ssl         BEST-RQ self-supervised encoder pretraining
  model_static      the decoder step on fixed-shape buffers: compiled, CUDA graphs, torch.export
  model_checkpoint  a checkpoint on disk -> the model, tokenizer and features (load_model)
decoding
  decode_search     features -> hypotheses: batched greedy and beam search, joint with CTC prefix scores
  decode_lm         a token n-gram of the training transcripts, fused into the beam search (tools/train_lm.py)
  decode_timing     time in the audio: pauses, long audio cut at them, CTC word times, chunks joined back
  decode_metrics    WER and BLEU, and the text normalisers leaderboards use; a stream's latency (AL, LAAL)
  decode_transcribe files -> Results: the API behind infer.py (transcribe)
  decode_policy     a stream's commit policy: commit a token now or hold it (wait-k, AlignAtt); stalls
  decode_stream     streams: decoding while the audio arrives, a sentence at a time, under the policy
training
  train_distributed torchrun ranks, DDP and FSDP2
  train_config      TrainConfig and its sections, train.py's arguments; the objectives (aed, rnnt, ssl)
  train_data        a run's training data: sources, sampler, DataLoader; bucket bins estimated from manifests
  train_setup       what a run is made of (TrainingSetup: model, optimizer, LR, precision, EMA), and its step
  train_progress    the progress line, metrics.jsonl, TensorBoard, FLOPs and MFU
  train_validation  dev loss, WER per language and BLEU per pair during training; whether the decoder listens
  train_guide       guided attention until the decoder listens; a fresh decoder when it never does
  train_checkpoint  a run's checkpoints written (DCP, completion marker); its state, data position included, loaded back
memory
  memory_measure    peak memory of a step, on the real device or a simulated CUDA device
  memory_oomptimizer the largest batch of every bucket, the memory model, a run's preflight check
commands
  cli_train         train.py (aed-train): a training run from its arguments to its last checkpoint
  cli_oom           oom.py (aed-oom): batch sizes for a config's buckets, written for train.py
  cli_stream        infer.py --stream's input and output: files and standard input as streams, latency
  cli_infer         infer.py (aed-infer): files -> transcripts, scores, timestamps, subtitles; or streams

The scripts at the top level only start the package's commands: train.py, oom.py and infer.py
(cli_train, cli_oom, cli_infer; installed: aed-train, aed-oom, aed-infer).
The package uses two top-level modules that import nothing from it, `sampler.py` and `bins.py` (2D
bucketing: the sampler, the bins and their allocation), so that they can be copied into another
codebase alone.
"""
from aed.decode_search import DecodingOptions
from aed.decode_stream import StreamConfig, Streamer
from aed.decode_transcribe import transcribe
from aed.model_checkpoint import load_model

__all__ = ["DecodingOptions", "StreamConfig", "Streamer", "load_model", "transcribe"]
