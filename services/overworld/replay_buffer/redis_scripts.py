"""The Lua scripts of the Redis replay index: one atomic step per state change.

The key layout they work on is described in redis_index.py.
"""

# Shared by every script. ARGV[1] is the key prefix; ARGV[2..4] the limiter (spi <= 0: none).
PRELUDE = r"""
local P = ARGV[1]
local META, DROPS, FIFO, BYVER = P .. 'meta', P .. 'drops', P .. 'fifo', P .. 'byver'
local SLOTS, PARTIAL, LIVE, SWEPT = P .. 'slots', P .. 'partial', P .. 'live', P .. 'swept'
local RESV, RESVX, WANT = P .. 'resv', P .. 'resvx', P .. 'want'
local SPI, ERR, MINSIZE = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])

-- (negative numbers are written 0 - x: Lua's -0 would reach Redis as "-0", not an integer)
local function num(v) return tonumber(v) or 0 end

local function lim_diff()
  local s = redis.call('HMGET', META, 'li', 'ls', 'lc')
  return num(s[1]) * SPI - num(s[2]) - num(s[3])
end

-- lim_diff with the reserved fragments counted as inserted (fpc: fragments per chunk)
local function insert_diff(fpc)
  return lim_diff() + num(redis.call('HGET', META, 'lr')) * SPI / fpc
end

local function can_insert(fpc)
  return insert_diff(fpc) + SPI <= SPI * MINSIZE + ERR
end

local function now_seconds()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end

-- {fragments, ttl} a holder has reserved, or {0, 0}
local function reservation(holder)
  local v = redis.call('HGET', RESV, holder)
  if not v then return 0, 0 end
  local count, ttl = string.match(v, '^(%d+)|(.*)$')
  return tonumber(count), tonumber(ttl)
end

local function set_reservation(holder, count, ttl, now)
  if count > 0 then
    redis.call('HSET', RESV, holder, count .. '|' .. ttl)
    redis.call('ZADD', RESVX, now + ttl, holder)
  else
    redis.call('HDEL', RESV, holder)
    redis.call('ZREM', RESVX, holder)
  end
end

-- Room of holders quiet for their ttl goes back.
local function expire_reservations(now)
  for _, holder in ipairs(redis.call('ZRANGEBYSCORE', RESVX, '-inf', now)) do
    local count = reservation(holder)
    redis.call('HINCRBY', META, 'lr', 0 - count)
    redis.call('HINCRBY', META, 'rx', count)
    set_reservation(holder, 0, 0, now)
  end
end

-- One fragment of `holder` takes room it reserved: true if it had some.
local function take_reservation(holder)
  if holder == '' then return false end
  local now = now_seconds()
  expire_reservations(now)
  local count, ttl = reservation(holder)
  if count == 0 then return false end
  redis.call('HINCRBY', META, 'lr', -1)
  set_reservation(holder, count - 1, ttl, now)
  return true
end

local function can_sample(size)
  return size >= MINSIZE and lim_diff() - 1 >= SPI * MINSIZE - ERR
end

local function lines(s)
  local out = {}
  if s and s ~= '' then
    for line in string.gmatch(s, '[^\n]+') do out[#out + 1] = line end
  end
  return out
end

local function srem_all(set, keys)
  for i = 1, #keys, 500 do
    redis.call('SREM', set, unpack(keys, i, math.min(i + 499, #keys)))
  end
end

-- Remove a held chunk for `reason`; returns its blob keys.
local function remove_chunk(id, reason)
  local ck = P .. 'chunk:' .. id
  local f = redis.call('HMGET', ck, 't', 'v', 'b', 'n', 'k')
  local times, v, b, n = num(f[1]), num(f[2]), num(f[3]), num(f[4])
  local keys = lines(f[5])
  redis.call('DEL', ck)
  redis.call('ZREM', FIFO, id)
  redis.call('ZREM', BYVER, id)
  redis.call('HINCRBY', DROPS, reason, 1)
  redis.call('HINCRBY', META, 'reuse_sum', times)
  redis.call('HINCRBY', META, 'reuse_count', 1)
  if SPI > 0 and SPI - times > 0 then
    redis.call('HINCRBYFLOAT', META, 'lc', SPI - times)
  end
  redis.call('HINCRBY', META, 'frags', 0 - n)
  redis.call('HINCRBY', META, 'bytes', 0 - b)
  redis.call('HINCRBY', META, 'vsum', 0 - v)
  if #keys > 0 then srem_all(LIVE, keys) end
  return keys
end
"""

# ARGV[5..]: slot, sequence, first model version, bytes, blob key, max_chunks, max_staleness,
# fragments_per_chunk, holder. Returns {status, stored, incomplete, stale on arrival, evicted, keys to delete...}.
ADD = PRELUDE + r"""
local slot, seq, ver, nb, key = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local max_chunks, max_staleness, fpc = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])

if redis.call('ZSCORE', SWEPT, key) then return {'swept', 0, 0, 0, 0} end
local last = redis.call('HGET', SLOTS, slot)
if last and seq <= tonumber(last) then
  if redis.call('SISMEMBER', LIVE, key) == 1 then return {'duplicate', 1, 0, 0, 0} end
  return {'duplicate', 1, 0, 0, 0, key}
end
if SPI > 0 and not take_reservation(ARGV[13]) and not can_insert(fpc) then return {'blocked', 0, 0, 0, 0} end
redis.call('HSET', SLOTS, slot, ARGV[6])
redis.call('HINCRBY', META, 'inserted', 1)
local version = num(redis.call('HGET', META, 'version'))
local function stale(v) return v < version - max_staleness end

local out = {'ok', 1, 0, 0, 0}
local entries = lines(redis.call('HGET', PARTIAL, slot))
if #entries > 0 then
  local last_seq = tonumber(string.match(entries[#entries], '^(%d+)|'))
  if last_seq + 1 ~= seq then
    out[3] = 1
    redis.call('HINCRBY', DROPS, 'incomplete', 1)
    for _, e in ipairs(entries) do
      local _, _, enb, ekey = string.match(e, '^(%d+)|(%d+)|(%d+)|(.*)$')
      redis.call('SREM', LIVE, ekey)
      redis.call('HINCRBY', META, 'frags', -1)
      redis.call('HINCRBY', META, 'bytes', 0 - tonumber(enb))
      out[#out + 1] = ekey
    end
    entries = {}
    redis.call('HDEL', PARTIAL, slot)
  end
end
if #entries == 0 and stale(ver) then
  out[2] = 0
  out[4] = 1
  redis.call('HINCRBY', DROPS, 'stale_on_arrival', 1)
  redis.call('HDEL', PARTIAL, slot)
  out[#out + 1] = key
  return out
end
entries[#entries + 1] = ARGV[6] .. '|' .. ARGV[7] .. '|' .. ARGV[8] .. '|' .. key
redis.call('SADD', LIVE, key)
redis.call('HINCRBY', META, 'frags', 1)
redis.call('HINCRBY', META, 'bytes', nb)
if #entries < fpc then
  redis.call('HSET', PARTIAL, slot, table.concat(entries, '\n'))
  return out
end
redis.call('HDEL', PARTIAL, slot)
-- zero-padded: byver orders chunks of one version by member, which is then their arrival order
local id = string.format('%012d', redis.call('HINCRBY', META, 'next_chunk', 1))
local keys, metas, total, first_v = {}, {}, 0, nil
for i, e in ipairs(entries) do
  local es, ev, enb, ekey = string.match(e, '^(%d+)|(%d+)|(%d+)|(.*)$')
  if i == 1 then first_v = tonumber(ev) end
  keys[#keys + 1] = ekey
  metas[#metas + 1] = es .. '|' .. ev .. '|' .. enb
  total = total + tonumber(enb)
end
if stale(first_v) then
  out[2] = 0
  out[4] = 1
  redis.call('HINCRBY', DROPS, 'stale_on_arrival', 1)
  srem_all(LIVE, keys)
  redis.call('HINCRBY', META, 'frags', 0 - #keys)
  redis.call('HINCRBY', META, 'bytes', 0 - total)
  for _, k in ipairs(keys) do out[#out + 1] = k end
  return out
end
redis.call('HSET', P .. 'chunk:' .. id, 't', 0, 'v', first_v, 'b', total, 'n', #keys, 's', slot,
           'k', table.concat(keys, '\n'), 'm', table.concat(metas, '\n'))
redis.call('ZADD', FIFO, id, id)
redis.call('ZADD', BYVER, first_v, id)
redis.call('HINCRBY', META, 'vsum', first_v)
if SPI > 0 then redis.call('HINCRBY', META, 'li', 1) end
while redis.call('ZCARD', FIFO) > max_chunks do
  local oldest = redis.call('ZRANGE', FIFO, 0, 0)[1]
  for _, k in ipairs(remove_chunk(oldest, 'evicted')) do out[#out + 1] = k end
  out[5] = out[5] + 1
end
return out
"""

# ARGV[5..]: holder, fragments wanted, ttl, fragments_per_chunk, fragments given back, of the fragments
# wanted those that would begin an episode, how long an unmet ask counts ahead of the others', the workers
# sharing the band. Returns the fragments granted.
RESERVE = PRELUDE + r"""
local holder, n, ttl, fpc, back = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local starting, demand_seconds, fleet = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local now = now_seconds()
expire_reservations(now)
local count, held_ttl = reservation(holder)
if ttl <= 0 then ttl = held_ttl end  -- a release alone keeps the holder's ttl
back = math.min(back, count)
count = count - back
local room = math.max(0, math.floor((SPI * MINSIZE + ERR - insert_diff(fpc) + back * SPI / fpc) / (SPI / fpc) + 1e-9))
-- room.grant in Lua: the tiers of an ask are (continuing, starting) within the holder's share of the band
-- less what it holds, then beyond; each tier of the asker waits behind the other holders' unmet asks
-- (remembered until their holders ask again) of the tiers before it
local share = math.max(1, math.ceil(math.floor((SPI * MINSIZE + ERR) / (SPI / fpc) + 1e-9) / math.max(1, fleet)))
local function tiers(c, s, held)
  local within = math.max(0, share - held)
  local c1 = math.min(c, within)
  local s1 = math.min(s, within - c1)
  return {c1, s1, c - c1, s - s1}
end
local ahead = {0, 0, 0, 0}
local wants = redis.call('HGETALL', WANT)
for i = 1, #wants, 2 do
  local c, s, untl = string.match(wants[i + 1], '^(%d+)|(%d+)|(.*)$')
  if not untl or tonumber(untl) <= now then
    redis.call('HDEL', WANT, wants[i])
  elseif wants[i] ~= holder then
    local t = tiers(tonumber(c), tonumber(s), (reservation(wants[i])))
    for k = 1, 4 do ahead[k] = ahead[k] + t[k] end
  end
end
local continuing = n - starting
local mine = tiers(continuing, starting, count)
local got, before = {0, 0, 0, 0}, 0
for k = 1, 4 do
  got[k] = math.max(0, math.min(mine[k], room - before))
  room = room - got[k]
  before = before + ahead[k]
end
local going_on, begun = got[1] + got[3], got[2] + got[4]
local granted = going_on + begun
if going_on < continuing or begun < starting then
  redis.call('HSET', WANT, holder, (continuing - going_on) .. '|' .. (starting - begun) .. '|' .. (now + demand_seconds))
else
  redis.call('HDEL', WANT, holder)
end
redis.call('HINCRBY', META, 'lr', granted - back)
if granted > 0 then
  set_reservation(holder, count + granted, ttl, now)
elseif back > 0 and count > 0 then  -- a release alone keeps the holder's expiry: it does not keep room alive
  redis.call('HSET', RESV, holder, count .. '|' .. held_ttl)
elseif back > 0 then
  set_reservation(holder, 0, 0, now)
end
return granted
"""

# ARGV[5..]: holders whose leases are gone. Their room goes back, counted as expired; returns how much.
FORGET_HOLDERS = PRELUDE + r"""
local back = 0
for i = 5, #ARGV do
  redis.call('HDEL', WANT, ARGV[i])
  local count = reservation(ARGV[i])
  if count > 0 then
    back = back + count
    set_reservation(ARGV[i], 0, 0, 0)
  end
end
redis.call('HINCRBY', META, 'lr', 0 - back)
redis.call('HINCRBY', META, 'rx', back)
return back
"""

# ARGV[5..]: n, max_reuse, seed, by reference ('1': the reader fetches the blobs itself; the Redis time
# is noted in refs_at), order ('oldest': by first model version, then arrival; 'uniform'). Returns
# {id, times, final, slot, keys, metas} per claimed chunk.
CLAIM = PRELUDE + r"""
local n, max_reuse = tonumber(ARGV[5]), tonumber(ARGV[6])
local ids
if ARGV[9] == 'oldest' then
  ids = redis.call('ZRANGE', BYVER, 0, n - 1)
else
  math.randomseed(tonumber(ARGV[7]))
  ids = redis.call('ZRANDMEMBER', FIFO, n)
  for i = #ids, 2, -1 do  -- ZRANDMEMBER returns the whole set in order when n >= its size
    local j = math.random(i)
    ids[i], ids[j] = ids[j], ids[i]
  end
end
local out = {}
for _, id in ipairs(ids) do
  if SPI > 0 then
    if not can_sample(redis.call('ZCARD', FIFO)) then break end
    redis.call('HINCRBY', META, 'ls', 1)
  end
  local ck = P .. 'chunk:' .. id
  local t = redis.call('HINCRBY', ck, 't', 1)
  redis.call('HINCRBY', META, 'sampled', 1)
  local f = redis.call('HMGET', ck, 's', 'k', 'm')
  local final = 0
  if t >= max_reuse then
    remove_chunk(id, 'reused')
    final = 1
  end
  out[#out + 1] = id
  out[#out + 1] = t
  out[#out + 1] = final
  out[#out + 1] = f[1]
  out[#out + 1] = f[2]
  out[#out + 1] = f[3]
end
if ARGV[8] == '1' and #out > 0 then
  local t = redis.call('TIME')
  redis.call('HSET', META, 'refs_at', t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
end
return out
"""

# Seconds since the last claim by reference (a string), or false when there was none.
REF_CLAIM_AGE = PRELUDE + r"""
local at = redis.call('HGET', META, 'refs_at')
if not at then return false end
local t = redis.call('TIME')
return tostring(tonumber(t[1]) + tonumber(t[2]) / 1e6 - tonumber(at))
"""

# ARGV[5..]: version, max_staleness. Returns {'ok', dropped chunks, keys...} or {'back', current}.
SET_VERSION = PRELUDE + r"""
local version, max_staleness = tonumber(ARGV[5]), tonumber(ARGV[6])
local current = num(redis.call('HGET', META, 'version'))
if version < current then return {'back', current} end
redis.call('HSET', META, 'version', ARGV[5])
local ids = redis.call('ZRANGEBYSCORE', BYVER, '-inf', '(' .. (version - max_staleness))
local out = {'ok', #ids}
for _, id in ipairs(ids) do
  for _, k in ipairs(remove_chunk(id, 'stale')) do out[#out + 1] = k end
end
return out
"""

STATS = PRELUDE + r"""
local m = redis.call('HMGET', META, 'frags', 'bytes', 'inserted', 'sampled', 'version', 'reuse_sum',
                     'reuse_count', 'vsum', 'li', 'ls', 'lc')
local oldest = redis.call('ZRANGE', BYVER, 0, 0, 'WITHSCORES')
return {m, redis.call('HGETALL', DROPS), redis.call('ZCARD', FIFO), oldest[2] or false,
        redis.call('HMGET', META, 'lr', 'rx')}
"""

# ARGV[5..]: now, retention, keys... Returns the keys no index entry references, now tombstoned.
CLAIM_ORPHANS = PRELUDE + r"""
local now, retention = tonumber(ARGV[5]), tonumber(ARGV[6])
local out = {}
for i = 7, #ARGV do
  if redis.call('SISMEMBER', LIVE, ARGV[i]) == 0 then
    redis.call('ZADD', SWEPT, now, ARGV[i])
    out[#out + 1] = ARGV[i]
  end
end
redis.call('ZREMRANGEBYSCORE', SWEPT, '-inf', now - retention)
return out
"""

# ARGV[5..]: keys. Returns those no index entry references (a read: nothing is tombstoned).
UNREFERENCED = PRELUDE + r"""
local out = {}
for i = 5, #ARGV do
  if redis.call('SISMEMBER', LIVE, ARGV[i]) == 0 then out[#out + 1] = ARGV[i] end
end
return out
"""

# ARGV[5..]: token, has token. Returns {0} when the token was already applied, else {1, keys...}.
RESET = PRELUDE + r"""
local token, has_token = ARGV[5], ARGV[6] == '1'
if has_token and redis.call('HGET', META, 'attempt') == token then return {0} end
local out = {1}
for _, k in ipairs(redis.call('SMEMBERS', LIVE)) do out[#out + 1] = k end
for _, id in ipairs(redis.call('ZRANGE', FIFO, 0, -1)) do redis.call('DEL', P .. 'chunk:' .. id) end
redis.call('DEL', META, DROPS, FIFO, BYVER, SLOTS, PARTIAL, LIVE, RESV, RESVX, WANT)
if has_token then redis.call('HSET', META, 'attempt', token) end
return out
"""

