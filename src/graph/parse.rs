//! Parser for the text form printed by [`super::print`].
//!
//! Accepts exactly what the printer writes, plus: comments (`; ...`) anywhere, blank lines, node
//! numbers that are not contiguous, and operands that refer to nodes defined further down. The
//! order of the lines becomes the schedule keys, so `print(parse(text)) == text` for any text the
//! printer wrote. Every error carries the 1-based line and column it concerns.

use hashbrown::HashMap;
use smallvec::SmallVec;
use thiserror::Error;

use super::{ComputeKind, DType, Edge, Graph, GroupId, NodeId, Op, ReduceOp, TensorType};

/// A syntax or reference error in graph text.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("line {line}, column {col}: {message}")]
pub struct ParseError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column (in characters).
    pub col: usize,
    /// What is wrong.
    pub message: String,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Str(String),
    Word(String),
    Ref(u32, Option<u32>),
    Punct(char),
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    col: usize,
}

fn err(line: usize, col: usize, message: impl Into<String>) -> ParseError {
    ParseError {
        line,
        col,
        message: message.into(),
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-'
}

fn tokenize(line_no: usize, line: &str) -> Result<Vec<Token>, ParseError> {
    let chars: Vec<char> = line.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let col = i + 1;
        if c.is_whitespace() {
            i += 1;
        } else if c == ';' {
            break;
        } else if c == '"' {
            let mut s = String::new();
            i += 1;
            loop {
                match chars.get(i) {
                    None => return Err(err(line_no, col, "unterminated string")),
                    Some('"') => {
                        i += 1;
                        break;
                    }
                    Some('\\') => {
                        match chars.get(i + 1) {
                            Some('"') => s.push('"'),
                            Some('\\') => s.push('\\'),
                            Some('n') => s.push('\n'),
                            _ => return Err(err(line_no, i + 1, "bad escape in string")),
                        }
                        i += 2;
                    }
                    Some(&ch) => {
                        s.push(ch);
                        i += 1;
                    }
                }
            }
            toks.push(Token {
                tok: Tok::Str(s),
                col,
            });
        } else if c == '%' {
            i += 1;
            let start = i;
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            let digits: String = chars[start..i].iter().collect();
            let n: u32 = digits
                .parse()
                .map_err(|_| err(line_no, col, "expected a node number after '%'"))?;
            let mut result = None;
            if chars.get(i) == Some(&'#') {
                i += 1;
                let s2 = i;
                while i < chars.len() && chars[i].is_ascii_digit() {
                    i += 1;
                }
                let d: String = chars[s2..i].iter().collect();
                result = Some(
                    d.parse()
                        .map_err(|_| err(line_no, s2 + 1, "expected a result index after '#'"))?,
                );
            }
            toks.push(Token {
                tok: Tok::Ref(n, result),
                col,
            });
        } else if is_word_char(c) {
            let start = i;
            while i < chars.len() && is_word_char(chars[i]) {
                i += 1;
            }
            toks.push(Token {
                tok: Tok::Word(chars[start..i].iter().collect()),
                col,
            });
        } else if "=(),:{}[]/".contains(c) {
            toks.push(Token {
                tok: Tok::Punct(c),
                col,
            });
            i += 1;
        } else {
            return Err(err(line_no, col, format!("unexpected character '{c}'")));
        }
    }
    Ok(toks)
}

struct Cursor<'a> {
    toks: &'a [Token],
    i: usize,
    line: usize,
    end_col: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<&'a Tok> {
        self.toks.get(self.i).map(|t| &t.tok)
    }
    fn col(&self) -> usize {
        self.toks.get(self.i).map_or(self.end_col, |t| t.col)
    }
    fn error(&self, message: impl Into<String>) -> ParseError {
        err(self.line, self.col(), message)
    }
    fn next(&mut self) -> Option<&'a Tok> {
        let t = self.toks.get(self.i).map(|t| &t.tok);
        self.i += 1;
        t
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: char) -> Result<(), ParseError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.error(format!("expected '{c}'")))
        }
    }
    fn word(&mut self, what: &str) -> Result<&'a str, ParseError> {
        match self.peek() {
            Some(Tok::Word(w)) => {
                self.i += 1;
                Ok(w)
            }
            _ => Err(self.error(format!("expected {what}"))),
        }
    }
    fn int<T: std::str::FromStr>(&mut self, what: &str) -> Result<T, ParseError> {
        let col = self.col();
        let w = self.word(what)?;
        w.parse()
            .map_err(|_| err(self.line, col, format!("expected {what}, found '{w}'")))
    }
    fn string(&mut self, what: &str) -> Result<String, ParseError> {
        match self.peek() {
            Some(Tok::Str(s)) => {
                self.i += 1;
                Ok(s.clone())
            }
            _ => Err(self.error(format!("expected {what} (a quoted string)"))),
        }
    }
    fn at_end(&self) -> bool {
        self.i >= self.toks.len()
    }
}

/// Attribute values as written.
#[derive(Clone, Debug)]
enum AttrVal {
    Word(String, usize),
    Ratio(u32, u32, usize),
}

struct ParsedNode {
    line: usize,
    op: Op,
    results: SmallVec<[TensorType; 1]>,
    operands: Vec<(u32, Option<u32>, usize)>,
    after: Vec<(u32, usize)>,
}

/// Parses graph text into a [`Graph`].
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let mut graph: Option<Graph> = None;
    let mut closed = false;
    let mut nodes: Vec<(u32, ParsedNode)> = Vec::new();
    let mut defined: HashMap<u32, usize> = HashMap::new();
    let mut last_line = 0;
    for (k, raw_line) in text.lines().enumerate() {
        let line_no = k + 1;
        last_line = line_no;
        let toks = tokenize(line_no, raw_line)?;
        if toks.is_empty() {
            continue;
        }
        let mut c = Cursor {
            toks: &toks,
            i: 0,
            line: line_no,
            end_col: raw_line.chars().count() + 1,
        };
        if closed {
            return Err(c.error("text after the closing '}'"));
        }
        let Some(g) = graph.as_mut() else {
            match c.next() {
                Some(Tok::Word(w)) if w == "graph" => {}
                _ => return Err(err(line_no, toks[0].col, "expected 'graph \"name\" {'")),
            }
            let name = c.string("the graph name")?;
            c.expect('{')?;
            if !c.at_end() {
                return Err(c.error("expected end of line after '{'"));
            }
            graph = Some(Graph::new(name));
            continue;
        };
        match c.peek() {
            Some(Tok::Punct('}')) => {
                c.next();
                if !c.at_end() {
                    return Err(c.error("expected end of line after '}'"));
                }
                closed = true;
            }
            Some(Tok::Word(w)) if w == "group" => {
                c.next();
                let col = c.col();
                let gname = c.word("a group name like g0")?;
                let id: u32 = gname
                    .strip_prefix('g')
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| err(line_no, col, format!("bad group name '{gname}'")))?;
                let key = c.word("'size'")?;
                if key != "size" {
                    return Err(err(line_no, col, "expected 'size=N'"));
                }
                c.expect('=')?;
                let size: u32 = c.int("a group size")?;
                if size == 0 {
                    return Err(err(line_no, col, "group size must be at least 1"));
                }
                if g.group_size(GroupId(id)).is_some() {
                    return Err(err(line_no, col, format!("group g{id} declared twice")));
                }
                g.declare_group(GroupId(id), size);
                if !c.at_end() {
                    return Err(c.error("expected end of line"));
                }
            }
            Some(Tok::Ref(n, None)) => {
                let n = *n;
                let col = c.col();
                c.next();
                if defined.contains_key(&n) {
                    return Err(err(line_no, col, format!("%{n} is defined twice")));
                }
                c.expect('=')?;
                let node = parse_node(&mut c)?;
                defined.insert(n, nodes.len());
                nodes.push((n, node));
            }
            _ => return Err(c.error("expected a node '%N = ...', 'group', or '}'")),
        }
    }
    let Some(mut graph) = graph else {
        return Err(err(
            last_line.max(1),
            1,
            "empty text: expected 'graph \"name\" {'",
        ));
    };
    if !closed {
        return Err(err(last_line + 1, 1, "missing closing '}'"));
    }
    let ids: Vec<NodeId> = nodes
        .iter()
        .map(|(_, p)| graph.add_node(p.op.clone(), p.results.iter().cloned(), &[]))
        .collect();
    for (k, (_, p)) in nodes.iter().enumerate() {
        for (slot, &(n, r, col)) in p.operands.iter().enumerate() {
            let Some(&src) = defined.get(&n) else {
                return Err(err(p.line, col, format!("%{n} is not defined")));
            };
            let result = r.unwrap_or(0);
            let count = nodes[src].1.results.len() as u32;
            if result >= count {
                return Err(err(
                    p.line,
                    col,
                    format!("%{n} has {count} result(s); #{result} does not exist"),
                ));
            }
            graph.add_edge(
                ids[src],
                ids[k],
                Edge::Data {
                    operand: slot as u32,
                    result,
                },
            );
        }
        for &(n, col) in &p.after {
            let Some(&src) = defined.get(&n) else {
                return Err(err(p.line, col, format!("%{n} is not defined")));
            };
            graph.add_order(ids[src], ids[k]);
        }
    }
    Ok(graph)
}

fn parse_node(c: &mut Cursor<'_>) -> Result<ParsedNode, ParseError> {
    let line = c.line;
    let kw_col = c.col();
    let kw = c.word("an op keyword")?;
    let mut name: Option<String> = None;
    if let Some(Tok::Str(_)) = c.peek() {
        name = Some(c.string("a name")?);
    }
    let mut attrs: Vec<(String, AttrVal, usize)> = Vec::new();
    while let Some(Tok::Word(key)) = c.peek() {
        if key == "after" {
            break;
        }
        let col = c.col();
        c.next();
        c.expect('=')?;
        let vcol = c.col();
        let v = c.word("an attribute value")?.to_string();
        let val = if c.eat('/') {
            let num: u32 = v
                .parse()
                .map_err(|_| err(line, vcol, "expected an integer ratio like 1/8"))?;
            let den: u32 = c.int("a denominator")?;
            AttrVal::Ratio(num, den, vcol)
        } else {
            AttrVal::Word(v, vcol)
        };
        if attrs.iter().any(|(k, _, _)| k == key) {
            return Err(err(line, col, format!("attribute '{key}' given twice")));
        }
        attrs.push((key.clone(), val, col));
    }
    let mut operands = Vec::new();
    if c.eat('(') && !c.eat(')') {
        loop {
            let col = c.col();
            match c.next() {
                Some(Tok::Ref(n, r)) => operands.push((*n, *r, col)),
                _ => return Err(err(line, col, "expected an operand like %3 or %3#1")),
            }
            if c.eat(')') {
                break;
            }
            c.expect(',')?;
        }
    }
    let mut after = Vec::new();
    if let Some(Tok::Word(w)) = c.peek()
        && w == "after"
    {
        c.next();
        c.expect('(')?;
        loop {
            let col = c.col();
            match c.next() {
                Some(Tok::Ref(n, None)) => after.push((*n, col)),
                _ => return Err(err(line, col, "expected a node like %3 in after(...)")),
            }
            if c.eat(')') {
                break;
            }
            c.expect(',')?;
        }
    }
    let mut results: SmallVec<[TensorType; 1]> = SmallVec::new();
    if c.eat(':') {
        loop {
            results.push(parse_type(c)?);
            if !c.eat(',') {
                break;
            }
        }
    }
    if !c.at_end() {
        return Err(c.error("unexpected text at end of node"));
    }
    let op = build_op(line, kw_col, kw, name, attrs)?;
    Ok(ParsedNode {
        line,
        op,
        results,
        operands,
        after,
    })
}

fn parse_type(c: &mut Cursor<'_>) -> Result<TensorType, ParseError> {
    let col = c.col();
    let d = c.word("a dtype like f32")?;
    let dtype =
        DType::from_name(d).ok_or_else(|| err(c.line, col, format!("unknown dtype '{d}'")))?;
    c.expect('[')?;
    let mut shape = SmallVec::new();
    if !c.eat(']') {
        loop {
            shape.push(c.int::<u64>("a dimension")?);
            if c.eat(']') {
                break;
            }
            c.expect(',')?;
        }
    }
    Ok(TensorType { dtype, shape })
}

fn build_op(
    line: usize,
    kw_col: usize,
    kw: &str,
    name: Option<String>,
    attrs: Vec<(String, AttrVal, usize)>,
) -> Result<Op, ParseError> {
    let mut attrs = attrs;
    let has_name = name.is_some();
    let mut take = |key: &str| -> Option<AttrVal> {
        let i = attrs.iter().position(|(k, _, _)| k == key)?;
        Some(attrs.remove(i).1)
    };
    let need_name = |name: Option<String>| {
        name.ok_or_else(|| err(line, kw_col, format!("'{kw}' needs a quoted name")))
    };
    let word = |v: Option<AttrVal>, key: &str| -> Result<(String, usize), ParseError> {
        match v {
            Some(AttrVal::Word(w, col)) => Ok((w, col)),
            Some(AttrVal::Ratio(_, _, col)) => {
                Err(err(line, col, format!("'{key}' takes a word, not a ratio")))
            }
            None => Err(err(line, kw_col, format!("'{kw}' needs '{key}=...'"))),
        }
    };
    let num = |v: Option<AttrVal>, key: &str| -> Result<u64, ParseError> {
        let (w, col) = word(v, key)?;
        w.parse()
            .map_err(|_| err(line, col, format!("'{key}' must be a non-negative integer")))
    };
    let reduce = |v: Option<AttrVal>| -> Result<ReduceOp, ParseError> {
        let (w, col) = word(v, "reduce")?;
        match w.as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "mean" => Ok(ReduceOp::Mean),
            _ => Err(err(line, col, format!("unknown reduce op '{w}'"))),
        }
    };
    let group = |v: Option<AttrVal>| -> Result<GroupId, ParseError> {
        let (w, col) = word(v, "group")?;
        w.strip_prefix('g')
            .and_then(|n| n.parse().ok())
            .map(GroupId)
            .ok_or_else(|| err(line, col, format!("bad group name '{w}'")))
    };
    let opt_bucket = |v: Option<AttrVal>| -> Result<Option<u32>, ParseError> {
        match v {
            None => Ok(None),
            v => Ok(Some(num(v, "bucket")? as u32)),
        }
    };
    let op = match kw {
        "parameter" => Op::Parameter {
            name: need_name(name)?,
        },
        "input" => Op::Input {
            name: need_name(name)?,
        },
        "compute" => {
            let (k, col) = word(take("kind"), "kind")?;
            Op::Compute {
                name: need_name(name)?,
                kind: ComputeKind::from_name(&k)
                    .ok_or_else(|| err(line, col, format!("unknown compute kind '{k}'")))?,
                flops: num(take("flops"), "flops")?,
            }
        }
        "gradient" => Op::Gradient {
            param: need_name(name)?,
        },
        "grad_sync" => Op::GradSync {
            param: need_name(name)?,
            reduce: reduce(take("reduce"))?,
            group: group(take("group"))?,
            ready: num(take("ready"), "ready")? as u32,
        },
        "all_reduce" => Op::AllReduce {
            reduce: reduce(take("reduce"))?,
            group: group(take("group"))?,
            bucket: opt_bucket(take("bucket"))?,
        },
        "all_reduce_start" => Op::AllReduceStart {
            reduce: reduce(take("reduce"))?,
            group: group(take("group"))?,
            bucket: opt_bucket(take("bucket"))?,
        },
        "all_reduce_done" => Op::AllReduceDone {
            bucket: opt_bucket(take("bucket"))?,
        },
        "bucket_pack" => {
            let bucket = num(take("bucket"), "bucket")? as u32;
            let scale_div = match take("scale") {
                None => None,
                Some(AttrVal::Ratio(1, d, col)) => {
                    if d == 0 {
                        return Err(err(line, col, "scale divisor must be at least 1"));
                    }
                    Some(d)
                }
                Some(AttrVal::Ratio(_, _, col) | AttrVal::Word(_, col)) => {
                    return Err(err(line, col, "scale must be written 1/N"));
                }
            };
            let align = match take("align") {
                None => super::PACK_ALIGN_BYTES,
                Some(v) => {
                    let col = match &v {
                        AttrVal::Word(_, c) | AttrVal::Ratio(_, _, c) => *c,
                    };
                    let n = num(Some(v), "align")?;
                    if !super::pack_align_ok(n) {
                        return Err(err(
                            line,
                            col,
                            format!(
                                "align must be a power of two from 1 to {} bytes",
                                super::MAX_PACK_ALIGN_BYTES
                            ),
                        ));
                    }
                    n as u32
                }
            };
            Op::BucketPack {
                bucket,
                scale_div,
                align,
            }
        }
        "bucket_unpack" => {
            let bucket = num(take("bucket"), "bucket")? as u32;
            let views = match take("as") {
                None => false,
                Some(AttrVal::Word(w, col)) => match w.as_str() {
                    "views" => true,
                    "copies" => false,
                    _ => return Err(err(line, col, "'as' must be views or copies")),
                },
                Some(AttrVal::Ratio(_, _, col)) => {
                    return Err(err(line, col, "'as' must be views or copies"));
                }
            };
            Op::BucketUnpack { bucket, views }
        }
        "sync" => Op::Sync,
        _ => return Err(err(line, kw_col, format!("unknown op '{kw}'"))),
    };
    let named = matches!(
        op,
        Op::Parameter { .. }
            | Op::Input { .. }
            | Op::Compute { .. }
            | Op::Gradient { .. }
            | Op::GradSync { .. }
    );
    if !named && has_name {
        return Err(err(line, kw_col, format!("'{kw}' takes no name")));
    }
    if let Some((k, _, col)) = attrs.first() {
        return Err(err(line, *col, format!("'{kw}' has no attribute '{k}'")));
    }
    Ok(op)
}
