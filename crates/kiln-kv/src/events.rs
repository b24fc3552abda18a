//! What changed in the prefix cache, for a router that keeps its own index of which replica
//! holds which prefix (llm-d's KV-cache indexer, Dynamo): blocks stored, blocks removed, all
//! cleared. Recorded only while [`BlockManager::record_cache_events`](crate::BlockManager::record_cache_events)
//! is on, and taken in order by [`BlockManager::take_cache_events`](crate::BlockManager::take_cache_events).

/// One change to the prefix cache. Hashes are the cache's own chained block hashes: a
/// consumer matches `Removed` against what `Stored` told it, and recomputes its own keys from
/// `token_ids` where it needs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Full blocks became reusable by later prompts: `hashes[i]` holds
    /// `token_ids[i * B .. (i + 1) * B]`, each block chained to the one before it and the first
    /// to `parent` (`None`: it starts a sequence).
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
    },
    /// Blocks left the cache (evicted for room); a later prompt no longer finds them.
    Removed { hashes: Vec<u64> },
    /// The whole cache was forgotten.
    AllCleared,
}

/// The events since they were last taken, merged as they come: a block stored right after
/// its parent extends the parent's event, as one prompt's blocks arrive in one event.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    on: bool,
    events: Vec<CacheEvent>,
}

impl EventLog {
    pub(crate) fn set_on(&mut self, on: bool) {
        self.on = on;
        if !on {
            self.events.clear();
        }
    }

    pub(crate) fn stored(&mut self, hash: u64, parent: Option<u64>, tokens: &[u32]) {
        if !self.on {
            return;
        }
        if let Some(CacheEvent::Stored {
            hashes, token_ids, ..
        }) = self.events.last_mut()
            && parent.is_some()
            && hashes.last().copied() == parent
        {
            hashes.push(hash);
            token_ids.extend_from_slice(tokens);
            return;
        }
        self.events.push(CacheEvent::Stored {
            hashes: vec![hash],
            parent,
            token_ids: tokens.to_vec(),
        });
    }

    pub(crate) fn removed(&mut self, hash: u64) {
        if !self.on {
            return;
        }
        if let Some(CacheEvent::Removed { hashes }) = self.events.last_mut() {
            hashes.push(hash);
        } else {
            self.events.push(CacheEvent::Removed { hashes: vec![hash] });
        }
    }

    pub(crate) fn cleared(&mut self) {
        if self.on {
            // What came before is void: a consumer forgets it all anyway.
            self.events.clear();
            self.events.push(CacheEvent::AllCleared);
        }
    }

    pub(crate) fn take(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }
}
