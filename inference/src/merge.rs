//! Merging encoder outputs into the LLM's input embeddings.
//!
//! A prompt holds, for each media item, a run of placeholder tokens, one per embedding the encoder
//! produces for that item. [`PlaceholderMap`] records where each item's run is; [`PlaceholderMap::merge`]
//! overwrites those rows of the prompt's embeddings with the item's encoder output. Runs are contiguous,
//! so each item is one row-block copy, not a per-token loop.

use std::ops::Range;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Where each media item's embeddings go in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceholderMap {
    /// Per item (in prompt order), its placeholder rows.
    pub items: Vec<Range<usize>>,
}

impl PlaceholderMap {
    /// Finds the runs of `placeholder` tokens in `ids` and assigns them to items of the given token
    /// counts in order. Adjacent items may share one run. Fails if the counts do not add up.
    pub fn build(ids: &[u32], placeholder: u32, item_tokens: &[usize]) -> Result<Self> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            if ids[i] == placeholder {
                let start = i;
                while i < ids.len() && ids[i] == placeholder {
                    i += 1;
                }
                runs.push(start..i);
            } else {
                i += 1;
            }
        }
        let mut items = Vec::with_capacity(item_tokens.len());
        let mut runs = runs.into_iter().peekable();
        for (n, &count) in item_tokens.iter().enumerate() {
            let run = runs.peek_mut().ok_or_else(|| {
                Error::Input(format!(
                    "media item {n} has no placeholder tokens left in the prompt"
                ))
            })?;
            if run.len() < count {
                return Err(Error::Input(format!(
                    "media item {n} needs {count} placeholder tokens, the prompt has a run of {} at {}",
                    run.len(),
                    run.start
                )));
            }
            items.push(run.start..run.start + count);
            run.start += count;
            if run.start == run.end {
                runs.next();
            }
        }
        if let Some(extra) = runs.next() {
            return Err(Error::Input(format!(
                "{} placeholder tokens at {} have no media item",
                extra.len(),
                extra.start
            )));
        }
        Ok(Self { items })
    }

    /// Writes each item's features (`[tokens, hidden]`, in item order) into its rows of `embeds`.
    pub fn merge<B: Backend>(&self, embeds: &mut Tensor<B>, features: &[&Tensor<B>]) -> Result<()> {
        if features.len() != self.items.len() {
            return Err(Error::Input(format!(
                "{} feature tensors for {} media items",
                features.len(),
                self.items.len()
            )));
        }
        for (rows, f) in self.items.iter().zip(features) {
            if f.rows() != rows.len() {
                return Err(Error::shape(
                    "merge",
                    format!(
                        "{} embeddings for {} placeholders at {}",
                        f.rows(),
                        rows.len(),
                        rows.start
                    ),
                ));
            }
            embeds.write_rows(rows.start, f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn items_fill_their_runs_in_order() {
        let ids = [5, 7, 7, 7, 6, 7, 7, 1];
        let map = PlaceholderMap::build(&ids, 7, &[2, 1, 2]).unwrap();
        assert_eq!(map.items, vec![1..3, 3..4, 5..7]);
        assert!(PlaceholderMap::build(&ids, 7, &[3, 3]).is_err());
        assert!(PlaceholderMap::build(&ids, 7, &[3]).is_err());
        assert!(PlaceholderMap::build(&ids, 7, &[3, 2, 1]).is_err());
    }

    #[test]
    fn merge_overwrites_exactly_the_placeholder_rows() {
        let dev = CpuBackend::new("test", 1).unwrap();
        let ids = [1, 9, 9, 2, 9];
        let map = PlaceholderMap::build(&ids, 9, &[2, 1]).unwrap();
        let mut embeds = Tensor::from_host(&dev, &[0.0; 10], &[5, 2]).unwrap();
        let a = Tensor::from_host(&dev, &[1.0, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let b = Tensor::from_host(&dev, &[5.0, 6.0], &[1, 2]).unwrap();
        map.merge(&mut embeds, &[&a, &b]).unwrap();
        assert_eq!(
            embeds.to_host().unwrap(),
            vec![0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 5.0, 6.0]
        );
        assert!(map.merge(&mut embeds, &[&b, &a]).is_err());
    }
}
