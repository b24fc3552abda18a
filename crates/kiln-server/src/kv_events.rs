//! Prefix-cache events over ZeroMQ in vLLM's format, for routers that keep their own index of
//! which replica caches which prefix (llm-d's KV-cache indexer, Dynamo).
//!
//! A PUB socket sends one 3-frame message per engine step that changed the cache: the topic,
//! an 8-byte big-endian sequence number (0, 1, 2, ...), and a msgpack payload
//! `[ts, [event, ...], data_parallel_rank]` whose events are arrays:
//! `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//! lora_name]`, `["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`. The
//! socket binds for a wildcard host (`tcp://*:5557`) and connects otherwise (llm-d's scheduler
//! binds; each engine pod connects). An optional ROUTER socket answers replay requests (an
//! 8-byte big-endian start sequence number) with every kept message from there, then the
//! end marker: sequence -1 and an empty payload.

use std::collections::VecDeque;

use kiln_engine::{CacheEvent, KvEventBatch};
use tokio::sync::mpsc::UnboundedReceiver;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where and how to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// `tcp://*:PORT` (bind) or `tcp://HOST:PORT` (connect).
    pub endpoint: String,
    /// `tcp://*:PORT` to answer replay requests (`None`: no replay).
    pub replay_endpoint: Option<String>,
    /// The first frame of every message (llm-d: `kv@POD_IP@MODEL`; vLLM's default is empty).
    pub topic: String,
    /// Messages kept for replay.
    pub buffer_steps: usize,
    /// Tokens per KV block, as every `BlockStored` says.
    pub block_size: usize,
}

impl KvEventsConfig {
    /// `endpoint`, no replay, an empty topic, 10,000 messages kept.
    pub fn new(endpoint: impl Into<String>, block_size: usize) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            block_size,
        }
    }
}

impl KvEventsConfig {
    /// Refuses an endpoint of the wrong form before anything starts.
    pub fn check(&self) -> Result<(), KvEventsError> {
        parse_endpoint(&self.endpoint)?;
        if let Some(r) = &self.replay_endpoint
            && !parse_endpoint(r)?.1
        {
            return Err(KvEventsError::Replay(r.clone()));
        }
        Ok(())
    }
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    #[error("--kv-events-endpoint {0}: expected tcp://HOST:PORT (connect) or tcp://*:PORT (bind)")]
    Endpoint(String),
    #[error("--kv-events-replay-endpoint {0}: expected tcp://*:PORT (the replay socket binds)")]
    Replay(String),
    #[error("cannot bind {endpoint}")]
    Bind {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
}

/// The endpoint as the ZeroMQ library takes it, and whether to bind it: a wildcard host binds
/// (as vLLM's publisher does), any other connects.
fn parse_endpoint(endpoint: &str) -> Result<(String, bool), KvEventsError> {
    let bad = || KvEventsError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    match host {
        "" => Err(bad()),
        "*" => Ok((format!("tcp://0.0.0.0:{port}"), true)),
        "[::]" | "::" => Ok((format!("tcp://[::]:{port}"), true)),
        _ => Ok((endpoint.to_owned(), false)),
    }
}

/// A running publisher: a task on the current tokio runtime that ends when the engine's event
/// channel closes (the engine stopped).
#[derive(Debug)]
pub struct KvEventPublisher {
    task: tokio::task::JoinHandle<()>,
}

impl KvEventPublisher {
    /// Binds (or starts connecting) the PUB socket, binds the replay socket, and publishes
    /// every batch `events` yields. A connect endpoint that is not up yet is retried in the
    /// background: the engine never waits for a router.
    pub async fn start(
        cfg: KvEventsConfig,
        events: UnboundedReceiver<KvEventBatch>,
    ) -> Result<Self, KvEventsError> {
        cfg.check()?;
        let (endpoint, bind) = parse_endpoint(&cfg.endpoint)?;
        let mut publisher = PubSocket::new();
        if bind {
            publisher
                .bind(&endpoint)
                .await
                .map_err(|source| KvEventsError::Bind {
                    endpoint: cfg.endpoint.clone(),
                    source,
                })?;
        }
        let mut replay = None;
        if let Some(r) = &cfg.replay_endpoint {
            let (local, _) = parse_endpoint(r)?;
            let mut socket = RouterSocket::new();
            socket
                .bind(&local)
                .await
                .map_err(|source| KvEventsError::Bind {
                    endpoint: r.clone(),
                    source,
                })?;
            replay = Some(socket);
        }
        tracing::info!(
            endpoint = %cfg.endpoint,
            role = if bind { "bind" } else { "connect" },
            replay = cfg.replay_endpoint.as_deref().unwrap_or("off"),
            topic = %cfg.topic,
            "publishing KV-cache events"
        );
        let task = tokio::spawn(run(
            cfg,
            (!bind).then_some(endpoint),
            publisher,
            replay,
            events,
        ));
        Ok(Self { task })
    }

    /// Waits until the engine's events end and the last batch is sent.
    pub async fn finished(self) {
        let _ = self.task.await;
    }
}

async fn run(
    cfg: KvEventsConfig,
    connect: Option<String>,
    mut publisher: PubSocket,
    mut replay: Option<RouterSocket>,
    mut events: UnboundedReceiver<KvEventBatch>,
) {
    // Until the router is up, messages go nowhere (as PUB drops them for a subscriber not
    // yet connected) but still take sequence numbers and stay for replay; the engine never
    // waits for a router.
    let mut pending = connect;
    let mut retry_at = tokio::time::Instant::now();
    let mut wait = std::time::Duration::from_millis(100);
    let topic = bytes::Bytes::from(cfg.topic.clone().into_bytes());
    let mut kept: VecDeque<(u64, bytes::Bytes)> = VecDeque::new();
    let mut seq = 0u64;
    loop {
        if let Some(endpoint) = &pending
            && tokio::time::Instant::now() >= retry_at
        {
            let tried = tokio::time::timeout(
                std::time::Duration::from_secs(1),
                publisher.connect(endpoint),
            )
            .await;
            match tried {
                Ok(Ok(())) => {
                    tracing::info!(%endpoint, "connected to the KV-event subscriber");
                    pending = None;
                }
                Ok(Err(e)) => {
                    tracing::warn!(%endpoint, error = %e, "cannot reach the KV-event subscriber; retrying");
                }
                Err(_) => {
                    tracing::warn!(%endpoint, "connecting to the KV-event subscriber timed out; retrying");
                }
            }
            retry_at = tokio::time::Instant::now() + wait;
            wait = (wait * 2).min(std::time::Duration::from_secs(5));
        }
        tokio::select! {
            () = tokio::time::sleep_until(retry_at), if pending.is_some() => {}
            batch = events.recv() => {
                let Some(batch) = batch else { break };
                let payload = bytes::Bytes::from(encode_batch(&batch, cfg.block_size));
                let mut msg = ZmqMessage::from(topic.clone());
                msg.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
                msg.push_back(payload.clone());
                if let Err(e) = publisher.send(msg).await {
                    tracing::warn!(seq, error = %e, "KV-event message not sent");
                }
                if cfg.buffer_steps > 0 {
                    if kept.len() == cfg.buffer_steps {
                        kept.pop_front();
                    }
                    kept.push_back((seq, payload));
                }
                seq += 1;
            }
            request = async { replay.as_mut()?.recv().await.ok() }, if replay.is_some() => {
                if let (Some(socket), Some(request)) = (replay.as_mut(), request) {
                    answer_replay(socket, request, &kept).await;
                }
            }
        }
    }
    tracing::debug!(sent = seq, "KV-event publisher stopped");
}

/// Answers one replay request, `[identity, "", start_seq]`: every kept message from
/// `start_seq` on as `[identity, "", seq, payload]`, then `[identity, "", -1, ""]`.
async fn answer_replay(
    socket: &mut RouterSocket,
    request: ZmqMessage,
    kept: &VecDeque<(u64, bytes::Bytes)>,
) {
    let frames = request.into_vec();
    let [identity, empty, start] = frames.as_slice() else {
        tracing::warn!(
            frames = frames.len(),
            "replay request of the wrong shape; ignored"
        );
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
        tracing::warn!(len = start.len(), "replay start is not 8 bytes; ignored");
        return;
    };
    let start = u64::from_be_bytes(start);
    let reply = |seq: bytes::Bytes, payload: bytes::Bytes| {
        let mut m = ZmqMessage::from(identity.clone());
        m.push_back(empty.clone());
        m.push_back(seq);
        m.push_back(payload);
        m
    };
    for (seq, payload) in kept.iter().filter(|(s, _)| *s >= start) {
        let msg = reply(
            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        );
        if socket.send(msg).await.is_err() {
            return;
        }
    }
    let end = reply(
        bytes::Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
        bytes::Bytes::new(),
    );
    let _ = socket.send(end).await;
}

/// One batch as vLLM's msgpack payload: `[ts, [event, ...], 0]`.
fn encode_batch(batch: &KvEventBatch, block_size: usize) -> Vec<u8> {
    use rmp::encode as mp;
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = mp::write_array_len(&mut out, 3);
    let _ = mp::write_f64(&mut out, batch.ts);
    let _ = mp::write_array_len(&mut out, batch.events.len() as u32);
    for e in &batch.events {
        match e {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
            } => {
                let _ = mp::write_array_len(&mut out, 8);
                let _ = mp::write_str(&mut out, "BlockStored");
                write_hashes(&mut out, hashes);
                match parent {
                    Some(p) => {
                        let _ = mp::write_uint(&mut out, *p);
                    }
                    None => {
                        let _ = mp::write_nil(&mut out);
                    }
                }
                let _ = mp::write_array_len(&mut out, token_ids.len() as u32);
                for &t in token_ids {
                    let _ = mp::write_uint(&mut out, u64::from(t));
                }
                let _ = mp::write_uint(&mut out, block_size as u64);
                let _ = mp::write_nil(&mut out); // lora_id
                let _ = mp::write_str(&mut out, "GPU"); // medium
                let _ = mp::write_nil(&mut out); // lora_name
            }
            CacheEvent::Removed { hashes } => {
                let _ = mp::write_array_len(&mut out, 3);
                let _ = mp::write_str(&mut out, "BlockRemoved");
                write_hashes(&mut out, hashes);
                let _ = mp::write_str(&mut out, "GPU");
            }
            CacheEvent::AllCleared => {
                let _ = mp::write_array_len(&mut out, 1);
                let _ = mp::write_str(&mut out, "AllBlocksCleared");
            }
        }
    }
    // data_parallel_rank: one engine per replica.
    let _ = mp::write_uint(&mut out, 0);
    out
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    let _ = rmp::encode::write_array_len(out, hashes.len() as u32);
    for &h in hashes {
        let _ = rmp::encode::write_uint(out, h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_bind_for_a_wildcard_and_connect_otherwise() {
        assert_eq!(
            parse_endpoint("tcp://*:5557").unwrap(),
            ("tcp://0.0.0.0:5557".to_owned(), true)
        );
        assert_eq!(
            parse_endpoint("tcp://10.0.0.7:5557").unwrap(),
            ("tcp://10.0.0.7:5557".to_owned(), false)
        );
        for bad in [
            "5557",
            "tcp://host",
            "tcp://:5557",
            "tcp://*:port",
            "ipc:///tmp/x",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }
}
