"""Guided attention until the decoder listens, and a new decoder when it never does.

train.attention_guide = [weight, steps] adds a loss that holds the decoder's cross-attention near a
path through the audio (the diagonal, or the CTC head's alignment: train.attention_guide_to) for
the first `steps` steps. With train.attention_guide_until=listening the guide also watches whether
the decoder uses the audio (its cross-entropy with other utterances' audio against its own, the
measure validation reports: aed/train_validation.py) and ends as soon as it does. A decoder still
deaf when the guide's steps are over is given fresh weights and guided again, up to
train.decoder_restarts times; after that the run stops and says what was measured.

    guide = GuideState()                                       # or the checkpoint's (resume_run)
    deaf = set_attention_guide(setup, batch, step, guide)      # every step, before the training step
    if deaf is not None and (message := act_on_deafness(setup, guide, step, deaf, validation, ema)):
        ...                                                    # save, then stop with the message
"""

import dataclasses
import logging

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from aed.train_setup import ExponentialMovingAverage, TrainingSetup
from aed.train_validation import LISTENING_GAP, batch_listening_gap, listens, whole_model

log = logging.getLogger(__name__)

GUIDE_CHECK_EVERY = 50  # steps between the checks that end train.attention_guide once the decoder listens
# A CTC head at or above this WER on every validation set has not learned the sounds (greedy, where
# an untrained head's blanks and babble score 100%).
ENCODER_LEARNED = 90.0
DECODER = ("decoder.", "encoder_decoder_proj.")  # the parameters a decoder restart draws anew


@dataclasses.dataclass
class GuideState:
    """Where train.attention_guide_until=listening stands, kept in checkpoints so that a resumed run
    guides the same steps: the step the guide ended at, whether a check is due at the next step
    (the last one found no rank with two rows to swap audio between), the step it last (re)started
    at, and the decoder restarts so far. A run that stopped on a decoder that does not listen saved
    a check as due: resumed, it checks at once, and restarts the decoder if the config now allows.
    After the guide ended, a due check is validation's request to look again (`validated`)."""
    ended: int | None = None
    check_due: bool = False
    start: int = 0
    restarts: int = 0

    def validated(self, results: dict) -> None:
        """A validation found the decoder deaf after the guide ended: the next step looks at its
        training batch, and the guide may resume."""
        if self.ended is not None and listens(results) is False:
            self.check_due = True


def set_attention_guide(setup: TrainingSetup, batch, step: int, guide: GuideState) -> float | None:
    """Sets the model's guided-attention weight for this step (train.attention_guide: [weight, steps],
    counted from `guide.start`). With attention_guide_until=listening, every GUIDE_CHECK_EVERY steps
    the decoder's cross-entropy on this step's first batch is measured with other utterances' audio
    against its own; once the gap reaches validation's LISTENING_GAP, the guide ends for good: it has
    taught the decoder to use the audio, and holding attention to a path any longer only constrains
    it. A check that finds no batch of two rows (long utterances: often one per batch) is repeated at
    the next step until one does. The last check falls on the guide's last step: returns its gap when
    the decoder is still deaf there (`act_on_deafness` takes it from there), else None. A check due
    after the guide ended (validation found the decoder deaf) brings the guide back, for its steps,
    if the training batch agrees."""
    cfg, model = setup.cfg, setup.model
    weight, steps = cfg.train.attention_guide
    since = step - guide.start
    deaf_at_end = None
    recheck = guide.ended is not None and guide.check_due
    if recheck or (guide.ended is None and 0 < since and (since % GUIDE_CHECK_EVERY == 0 or since == steps
                                                         or guide.check_due)
                   and (since <= steps or guide.check_due) and cfg.train.attention_guide_until == "listening"):
        def whole():  # the copy validation decodes with: a sharded model's layers run only inside its forward
            return whole_model(model, lambda: setup.objective.build(cfg, setup.tokenizer.vocab_size))

        gap = batch_listening_gap(whole, batch, next(model.parameters()).device, setup.precision, cfg.freeze)
        guide.check_due = gap is None
        if gap is None and step % GUIDE_CHECK_EVERY == 0:  # once per period, so a run that never can measure says so
            log.info("step %d: no rank has two utterances in its batch to swap audio between: the attention guide's "
                     "check is repeated at the next steps until one has", step)
        if gap is not None and recheck:
            if gap < LISTENING_GAP:
                log.warning("*** step %d: the decoder no longer uses the audio (%.2f nats/token on its training batch, "
                            "and deaf at the last validation), though it did when its attention guide ended at step "
                            "%d: the guide resumes for up to %d steps ***", step, gap, guide.ended, int(steps))
                guide.ended, guide.start, since = None, step, 0
            else:
                log.info("step %d: the decoder's cross-entropy on its training batch is %.2f nats/token higher with "
                         "other utterances' audio than with its own: it listens, the attention guide stays off", step, gap)
        elif gap is not None:
            if gap >= LISTENING_GAP:
                guide.ended = step
            elif since >= steps:
                deaf_at_end = gap
            log.info("step %d: the decoder's cross-entropy on its training batch is %.2f nats/token higher with "
                     "other utterances' audio than with its own: %s", step, gap,
                     "it listens, attention guide off" if guide.ended is not None else
                     "the guide's steps are over" if deaf_at_end is not None else
                     f"attention guide stays on until {LISTENING_GAP} (or step {guide.start + int(steps)})")
    ramp = cfg.train.attention_guide_ramp
    weight *= min(1.0, since / ramp) if ramp else 1.0  # weak while the CTC head that sets the path is still untrained
    model.attention_guide = weight if since < steps and guide.ended is None else 0.0
    model.guide_to, model.guide_heads = cfg.train.attention_guide_to, cfg.train.attention_guide_heads
    return deaf_at_end
def restart_decoder(setup: TrainingSetup, step: int, ema: ExponentialMovingAverage | None) -> None:
    """Gives the decoder (and the projection into it) the weights a new model of this config would
    draw, seeded by the step so that every rank draws the same, and drops their optimizer moments;
    the encoder and CTC head keep what they have learned. A decoder that has settled on predicting
    the text from the text alone gets little gradient toward the audio; a fresh one meets an encoder
    that already tells sounds apart, and the guide points it at them again."""
    cfg, model = setup.cfg, setup.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + step)
        fresh = setup.objective.build(cfg, setup.tokenizer.vocab_size).state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(DECODER):
                new = fresh[name].to(p.device, p.dtype)
                if isinstance(p, DTensor):  # FSDP2: this rank's shard of the same full tensor
                    new = distribute_tensor(new, p.device_mesh, p.placements)
                p.copy_(new)
                setup.optimizer.state.pop(p, None)  # AdamW starts its moments anew at the next step
    if ema is not None:
        ema.reset(model)


def act_on_deafness(setup: TrainingSetup, guide: GuideState, step: int, gap: float, validation: dict | None,
                    ema: ExponentialMovingAverage | None) -> str | None:
    """The guide's steps ended with a decoder that does not use the audio (its training-batch gap
    `gap`, under LISTENING_GAP): restart the decoder and guide it again, up to train.decoder_restarts
    times, saying so in one line; after that, or at once when the last validation found the CTC
    head's WER near 100% (an encoder that has not learned the sounds gives a new decoder nothing to
    listen to either), the message the run stops with: what was measured and what to try. Every
    rank decides alike: the gap is all-reduced, validation's results are the same on every rank."""
    cfg = setup.cfg
    steps = int(cfg.train.attention_guide[1])
    ctc = {k: v for k, v in (validation or {}).items() if k.endswith("/ctc_wer")}
    heard = ", ".join(f"{k[:-len('/ctc_wer')]} {v:.1f}%" for k, v in ctc.items())
    measured = (f"after {steps} guided steps (step {step}) the decoder's cross-entropy on its training batch is "
                f"{gap:+.2f} nats/token with other utterances' audio (a decoder that listens: over {LISTENING_GAP})"
                + (f"; the CTC head's WER at the last validation: {heard}" if heard else ""))
    encoder_learned = min(ctc.values()) < ENCODER_LEARNED if ctc else None
    if guide.restarts < cfg.train.decoder_restarts and encoder_learned is not False:
        restart_decoder(setup, step, ema)
        guide.restarts, guide.start, guide.ended, guide.check_due = guide.restarts + 1, step, None, False
        log.warning("*** the decoder does not use the audio: %s. Restarting the decoder from fresh weights on the encoder "
                    "trained so far, guided again for up to %d steps (restart %d of train.decoder_restarts=%d) ***",
                    measured, steps, guide.restarts, cfg.train.decoder_restarts)
        return None
    guide.check_due = True  # resumed, the run checks again at once
    advice = ("The encoder has learned the sounds (the CTC head transcribes them) but the decoder does not attend "
              "to them: raise train.attention_guide's weight or steps, or train.decoder_restarts"
              if encoder_learned else
              "The encoder has not learned the sounds either (the CTC head's WER is near 100%): the decoder has "
              "nothing to listen to. Check that the transcripts belong to their audio (tools/inspect_data.py), "
              "lower optim.lr or raise optim.warmup_steps, or train the encoder alone first (model.ctc_loss_weight, "
              "init_from with init_encoder_only)" if encoder_learned is False else
              "Validate (val.manifests, val.every) with a CTC head (model.ctc_loss_weight > 0) to see whether the encoder "
              "has learned the sounds; "
              "check that the transcripts belong to their audio (tools/inspect_data.py)")
    return (f"stopping: the decoder does not use the audio after {guide.restarts} decoder restart(s): {measured}. "
            f"Training on would make a language model of the text. {advice} (docs/training.md). Rerun the same "
            f"command to resume from this step with a changed config (raising train.decoder_restarts restarts the "
            f"decoder again).")
